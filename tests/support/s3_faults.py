"""A moto S3 server that tests can stop, restart on the same port, and make answer with faults.

The session's ``s3_server`` (tests/conftest.py) is shared by every test and must stay up; the
tests of the store's own faults run against a :class:`FaultyS3Server` of their own::

    with FaultyS3Server() as s3:                 # moto on 127.0.0.1, one bucket
        url = s3.url("run7/iter_10")             # s3://<bucket>/run7/iter_10
        opts = s3.options()                      # endpoint + credentials + a short retry window
        s3.inject(503, "SlowDown", times=3)      # the next 3 requests are answered 503 SlowDown
        s3.stop_on(lambda r: r.method == "PUT" and ".distcp" in r.path)   # stop when one arrives
        s3.stop(); s3.restart()                  # an outage, then the same port again

Faults are a WSGI middleware in front of moto's app (this process serves it, so the rank pool's
processes reach it over HTTP like any client): an *injected answer* (a status with an S3 error
body, as AWS words it) for the next ``times`` requests that match, and a *trip-wire* that stops
the server when a matching request arrives (that request is answered 500, and every later one
finds the port closed: connection refused). moto keeps its buckets and objects in this process,
so they survive a restart. :class:`CountingStore` (below) cuts a store at its Nth request
instead, on any store.
"""

from __future__ import annotations

import dataclasses
import threading
import urllib.request
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

from distckpt.core import CheckpointingException
from distckpt.storage.base import Store, Writer

BUCKET = "distckpt-faults"
# A retry window short enough for a test: obstore's own retries of transient errors stay on
# (the behaviour under test), bounded to about a second.
FAST_RETRY = {
    "max_retries": 3,
    "backoff": {
        "init_backoff": timedelta(milliseconds=20),
        "max_backoff": timedelta(milliseconds=200),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=2),
}


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str  # with the query string


_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<RequestId>fault</RequestId></Error>"
)
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "InternalError": "We encountered an internal error. Please try again.",
    "AccessDenied": "Access Denied",
    "TooManyRequests": "Too many requests.",
    "NoSuchBucket": "The specified bucket does not exist",
}


class _Faults:
    """The middleware: injected answers and the trip-wire, under one lock."""

    def __init__(self, app, server: FaultyS3Server):
        self.app, self.server = app, server
        self.lock = threading.Lock()
        self.answers: List[list] = []  # [status, code, times left, match]
        self.trip: Optional[Callable[[Request], bool]] = None
        self.seen: List[Request] = []

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if environ.get("QUERY_STRING"):
            path += "?" + environ["QUERY_STRING"]
        request = Request(environ["REQUEST_METHOD"], path)
        with self.lock:
            self.seen.append(request)
            answer = None
            for rule in self.answers:
                if rule[2] > 0 and (rule[3] is None or rule[3](request)):
                    rule[2] -= 1
                    answer = rule
                    break
            tripped = self.trip is not None and self.trip(request)
            if tripped:
                self.trip = None
        if tripped:
            threading.Thread(target=self.server.stop, daemon=True).start()
            answer = [500, "InternalError"]
        if answer is None:
            return self.app(environ, start_response)
        status, code = answer[0], answer[1]
        body = _ERROR_BODY.format(code=code, message=_MESSAGES.get(code, code)).encode()
        reason = {403: "Forbidden", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}
        reason = reason.get(status, "Service Unavailable")
        start_response(
            f"{status} {reason}", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
        )
        return [body]


class FaultyS3Server:
    """moto's S3 on 127.0.0.1 with one bucket, fault injection, stop and restart on the same port."""

    def __init__(self, bucket: str = BUCKET):
        self.bucket = bucket
        self.port = 0
        self._moto = None
        self._faults: Optional[_Faults] = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> FaultyS3Server:
        from moto.server import ThreadedMotoServer

        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._moto.start()
        werkzeug = self._moto._server
        self.port = werkzeug.server_address[1]
        self._faults = _Faults(werkzeug.app, self)
        werkzeug.app = self._faults
        self._stopped.clear()
        if not getattr(self, "_bucket_made", False):
            urllib.request.urlopen(
                urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT"), timeout=10
            )
            self._bucket_made = True
        return self

    def stop(self) -> None:
        """Stop serving and close the port (a client then meets connection refused)."""
        moto = self._moto
        if moto is None or self._stopped.is_set():
            return
        self._stopped.set()
        moto.stop()
        moto._server.server_close()

    def restart(self) -> None:
        """Serve again on the same port, with the same buckets and objects (moto keeps them)."""
        self._stopped.wait(10)
        self.start()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def wait_stopped(self, timeout: float) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> FaultyS3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ addresses

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def options(self, **extra) -> Dict[str, object]:
        """``storage_options`` that reach this server (whatever the environment says)."""
        opts = {
            "endpoint": self.endpoint,
            "access_key_id": "testing",
            "secret_access_key": "testing",
            "region": "us-east-1",
            "allow_http": True,
            "retry_config": FAST_RETRY,
        }
        opts.update(extra)
        return opts

    # ------------------------------------------------------------------ faults

    def inject(
        self, status: int, code: str, times: int = 1, match: Optional[Callable[[Request], bool]] = None
    ):
        """Answer the next ``times`` requests that ``match`` (None: any) with ``status`` and an
        S3 error body carrying ``code``."""
        with self._faults.lock:
            self._faults.answers.append([status, code, times, match])

    def stop_on(self, match: Callable[[Request], bool]) -> None:
        """Stop the server when a request that ``match`` arrives (it is answered 500)."""
        with self._faults.lock:
            self._faults.trip = match

    def clear(self) -> None:
        with self._faults.lock:
            self._faults.answers.clear()
            self._faults.trip = None
            self._faults.seen.clear()

    @property
    def seen(self) -> List[Request]:
        with self._faults.lock:
            return list(self._faults.seen)


# --------------------------------------------------------------------------- cutting any store


class StoreCut(CheckpointingException):
    """The request a :class:`CountingStore` was told to fail."""


class _CountingWriter(Writer):
    def __init__(self, store: CountingStore, name: str, inner: Writer):
        self.store, self.name, self.inner = store, name, inner

    def write(self, data) -> int:
        return self.inner.write(data)

    def close(self) -> None:
        self.store.run("close upload", self.name, self.inner.close)

    def abort(self) -> None:
        self.inner.abort()


class CountingStore(Store):
    """``inner`` with every request counted; from request ``cut_at`` on (1-based; None: never)
    each one fails with :class:`StoreCut` before reaching ``inner``, until :meth:`heal` (an
    outage that begins at a chosen point: what a crash or a lost network does to the code after
    it). ``only_one``: fail request ``cut_at`` alone (a single error the code must handle).
    ``lose_answer``: request ``cut_at`` reaches ``inner`` and is done, then fails (its answer was
    lost, as when a connection drops after the server acted). ``on_request(n)`` runs before
    request ``n`` goes out (what else happens at that moment). ``log`` lists every request as
    ``(operation, name)``, the cut ones too."""

    def __init__(
        self,
        inner: Store,
        cut_at: Optional[int] = None,
        only_one: bool = False,
        on_request: Optional[Callable[[int], None]] = None,
        lose_answer: bool = False,
    ):
        self.inner, self.cut_at, self.only_one, self.on_request = inner, cut_at, only_one, on_request
        self.lose_answer = lose_answer
        self.count = 0
        self.log: List[tuple] = []
        self._lock = threading.Lock()
        for flag in (
            "supports_rename",
            "supports_mmap",
            "supports_conditional_put",
            "supports_ranged_read",
            "supports_versioned_put",
        ):
            setattr(self, flag, getattr(inner, flag, False))

    def heal(self) -> None:
        self.cut_at = None

    def run(self, operation: str, name: str, call):
        """Count one request and send it (``call()``), or fail it as configured."""
        with self._lock:
            self.count += 1
            self.log.append((operation, name))
            n, cut = self.count, self.cut_at
        if self.on_request is not None:
            self.on_request(n)
        hit = cut is not None and (n == cut if self.only_one or self.lose_answer else n >= cut)
        if hit and not self.lose_answer:
            raise StoreCut(f"{self.where(name)}: {operation} cut (request {n})")
        result = call()
        if hit:
            raise StoreCut(f"{self.where(name)}: {operation} done, its answer lost (request {n})")
        return result

    @property
    def url(self) -> str:
        return self.inner.url

    def where(self, name: str) -> str:
        return self.inner.where(name)

    def child(self, name: str) -> Store:
        return self.inner.child(name)

    def put(self, name, data) -> None:
        self.run("put", name, lambda: self.inner.put(name, data))

    def put_if_absent(self, name, data) -> bool:
        return self.run("put_if_absent", name, lambda: self.inner.put_if_absent(name, data))

    def get(self, name):
        return self.run("get", name, lambda: self.inner.get(name))

    def get_ranges(self, name, starts: Sequence[int], lengths: Sequence[int]):
        return self.run("get_ranges", name, lambda: self.inner.get_ranges(name, starts, lengths))

    def size(self, name) -> int:
        return self.run("size", name, lambda: self.inner.size(name))

    def delete(self, name) -> None:
        self.run("delete", name, lambda: self.inner.delete(name))

    def list(self, prefix: str = ""):
        return self.run("list", prefix, lambda: self.inner.list(prefix))

    def list_objects(self, prefix: str = ""):
        return self.run("list", prefix, lambda: self.inner.list_objects(prefix))

    def open_writer(self, name) -> Writer:
        return _CountingWriter(
            self, name, self.run("open upload", name, lambda: self.inner.open_writer(name))
        )

    def get_versioned(self, name):
        return self.run("get_versioned", name, lambda: self.inner.get_versioned(name))

    def put_versioned(self, name, data, expected) -> bool:
        return self.run("put_versioned", name, lambda: self.inner.put_versioned(name, data, expected))

    def copy(self, src: str, dst: str) -> None:
        self.run("copy", dst, lambda: self.inner.copy(src, dst))

    def committed_version(self, refresh: bool = False):
        return self.inner.committed_version(refresh)

    def begin_save(self, commit_names, overwrite) -> None:
        self.inner.begin_save(commit_names, overwrite)

    def commit(self, name, data) -> None:
        self.run("commit", name, lambda: self.inner.commit(name, data))
