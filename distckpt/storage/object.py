"""Object stores (S3, GCS, Azure, memory) as a :class:`~distckpt.storage.base.Store`, via obstore.

obstore is a Rust client (``object_store``) that releases the GIL, signs requests itself and
retries throttling, 5xx and dropped connections with exponential backoff and jitter. Nothing here
speaks HTTP.

Configuration, lowest precedence first:

1. the usual environment, read by obstore: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
   ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``;
   ``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT``; ``AZURE_STORAGE_ACCOUNT_NAME``,
   ``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN`` ... An AWS profile
   (``AWS_PROFILE`` or the ``profile`` option) is resolved through boto3 when it is installed.
2. ``storage_options``: any key of obstore's per-store config (``endpoint``, ``region``,
   ``access_key_id`` ...; values that are not strings are written as strings, ``True`` as
   ``"true"``), any key of obstore's HTTP client config given flat (``allow_http``, ``timeout``,
   ``proxy_url`` ...: they go into ``client_options``), plus
   ``client_options`` (dict), ``retry_config`` (dict), and distckpt's own knobs:
   ``part_size`` (multipart part size, default 16 MiB), ``max_concurrency`` (parts in flight per
   upload, default 4), ``coalesce`` (ranged reads closer than this many bytes become one request,
   default 1 MiB).

Memory per upload stays below ``part_size * (max_concurrency + 1)``.

Failures are classified (:mod:`distckpt.storage.failures`): a missing bucket, refused access,
throttling and transient errors each raise their own exception naming the remote object, the
request and the server's answer; a missing object is a ``FileNotFoundError``. Reads resolve names
through the prefix's commit record when it has one (:mod:`distckpt.storage.record`, read once per
operation: the first read after the store was opened, written to, or refreshed).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

import obstore
from obstore import exceptions as obe
from obstore.store import MemoryStore, from_url

from distckpt import containment
from distckpt.core import CheckpointingException
from distckpt.storage import cloud_env
from distckpt.storage import record as records
from distckpt.storage.base import Store, Writer
from distckpt.storage.failures import UnavailableError, classify, parse_answer

DEFAULT_PART_SIZE = 16 << 20
DEFAULT_MAX_CONCURRENCY = 4
DEFAULT_COALESCE = 1 << 20
DEFAULT_RETRY = {
    "max_retries": 10,
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
    "retry_timeout": timedelta(minutes=3),
}
_OWN_OPTIONS = ("part_size", "max_concurrency", "coalesce", "client_options", "retry_config", "profile")
# obstore's HTTP client settings (``ClientConfig``): accepted flat in storage_options and moved into
# client_options, since a store's own config refuses them.
CLIENT_OPTION_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "randomize_addresses",
        "read_timeout",
        "root_certificate",
        "timeout",
        "user_agent",
    }
)

_UNREAD = object()  # the commit record is yet to be read

# memory:// stores live as long as the process: one per bucket name, shared by every open_store.
_MEMORY: Dict[str, MemoryStore] = {}
_MEMORY_LOCK = threading.Lock()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def upload_failure(e: BaseException, where: str) -> BaseException:
    """The error of a streaming upload. object_store aborts a multipart upload whose part or
    completion failed, and when the abort (``DELETE ...?uploadId=``) fails too, as it does when
    the store went away, only the abort's error comes back: the upload is what failed, and is
    reported so, classified by what the abort met."""
    answer = parse_answer(e)
    if answer.request and answer.request.startswith("DELETE") and "uploadId=" in answer.request:
        note = (
            "; a part or the completion of this multipart upload failed and its abort failed too (the "
            "abort's error is shown: obstore reports no other); the incomplete upload stays invisible "
            "until the bucket's lifecycle rule for incomplete multipart uploads removes it"
        )
        failed = classify(e, where, "upload", writing=True)
        if isinstance(failed, FileNotFoundError):
            failed = UnavailableError(where, "upload", answer)
        failed.args = (failed.args[0] + note,)
        return failed
    return classify(e, where, "upload", writing=True)


def owned(data) -> bytes:
    """``data`` as bytes obstore may keep. obstore takes buffers without copying them: its
    writer holds what it is given until the part is uploaded, and an in-memory store holds a put's
    buffer for good, each sending or serving whatever that memory then holds. A buffer its caller
    reuses (a staging buffer's next wave, a pinned slot's next piece) would go out changed, under
    the CRC32C of the bytes it had. So a mutable buffer is copied; ``bytes`` go as they are."""
    return data if isinstance(data, bytes) else bytes(data)


class _ObjectWriter(Writer):
    def __init__(self, store: ObjectStore, name: str):
        self.where = store.where(name)
        self._file = obstore.open_writer(
            store._store, store._key(name), buffer_size=store.part_size, max_concurrency=store.max_concurrency
        )
        self._done = False

    def write(self, data) -> int:
        try:
            return self._file.write(owned(data))
        except Exception as e:  # noqa: BLE001 - every client error becomes ours, with the object
            failed = upload_failure(e, self.where)
            self.abort()
            raise failed from e

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._file.close()
        except Exception as e:  # noqa: BLE001
            raise upload_failure(e, self.where) from e

    def abort(self) -> None:
        """Abort: obstore aborts the multipart upload when its writer exits with an exception."""
        if self._done:
            return
        self._done = True
        try:
            self._file.__exit__(RuntimeError, RuntimeError("aborted"), None)
        except Exception:  # noqa: BLE001 - nothing more to clean up
            pass


class ObjectStore(Store):
    """A key prefix in a bucket (``s3://bucket/run/iter_100``, ``gs://``, ``az://``, ``memory://``).

    There is no rename and no mmap; a put is atomic (an object is never seen half-written), and
    a conditional put (``If-None-Match: *``) makes ``metadata.json`` the commit.
    """

    supports_rename = False
    supports_mmap = False
    supports_conditional_put = True
    supports_ranged_read = True
    supports_versioned_put = True

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None):
        self._url = url.rstrip("/")
        self.options = dict(storage_options or {})
        # what the clouds' own tools read (STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING)
        opts = cloud_env.fill(urlparse(self._url).scheme, dict(self.options))
        self.part_size = _positive_int(self._url, opts, "part_size", DEFAULT_PART_SIZE)
        self.max_concurrency = _positive_int(self._url, opts, "max_concurrency", DEFAULT_MAX_CONCURRENCY)
        self.coalesce = _positive_int(self._url, opts, "coalesce", DEFAULT_COALESCE, minimum=0)
        self._view = _UNREAD
        client_options = dict(opts.pop("client_options", None) or {})
        for key in [k for k in opts if k.lower() in CLIENT_OPTION_KEYS]:
            client_options.setdefault(key.lower(), opts.pop(key))
        client_options = client_options or None
        retry_config = opts.pop("retry_config", None) or DEFAULT_RETRY
        opts = {k: _config_text(v) for k, v in opts.items()}
        profile = opts.pop("profile", None)
        parsed = urlparse(self._url)
        self.scheme = parsed.scheme
        self._prefix = ""
        if self.scheme == "memory":
            with _MEMORY_LOCK:
                self._store = _MEMORY.setdefault(parsed.netloc, MemoryStore())
            self._prefix = parsed.path.strip("/")
            return
        kwargs: Dict[str, Any] = {}
        provider = _aws_profile_provider(profile) if self.scheme in ("s3", "s3a") else None
        if provider is not None:
            kwargs["credential_provider"] = provider
        try:
            self._store = from_url(
                self._url,
                config=opts or None,
                client_options=client_options,
                retry_config=retry_config,
                **kwargs,
            )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - obstore can panic (a BaseException) on odd config
            raise CheckpointingException(f"{self._url}: cannot open object store ({_first_line(e)})") from e

    def __getstate__(self):
        return {"url": self._url, "options": self.options}

    def __setstate__(self, state):
        self.__init__(state["url"], state["options"])

    @property
    def url(self) -> str:
        return self._url

    def _key(self, name: str, what: str = "object name") -> str:
        """The full key of ``name``: the containment rule (a plain relative name) keeps it below
        this store's prefix."""
        containment.check_name(name, self._url, what)
        return f"{self._prefix}/{name}" if self._prefix else name

    def child(self, name: str) -> ObjectStore:
        # The same client (building one costs milliseconds: credentials, TLS, connection pool),
        # with the folder added to the key prefix.
        folder = containment.check_name(name.strip("/"), self._url, "folder name")
        sub = object.__new__(type(self))  # not copy.copy: __setstate__ would build a new client
        sub.__dict__.update(self.__dict__)
        sub._url = f"{self._url}/{folder}"
        sub._prefix = f"{self._prefix}/{folder}" if self._prefix else folder
        sub._view = _UNREAD  # a folder below a checkpoint is a checkpoint of its own
        return sub

    def _fail(self, name: str, what: str, e: BaseException, writing: bool = False):
        raise classify(e, self.where(name), what, writing) from e

    # ---------------------------------------------------------------- the commit record

    def committed_version(self, refresh: bool = False) -> Optional[records.CommitRecord]:
        """The prefix's commit record (None without one), read on first use after the store was
        opened, written to, or asked to ``refresh``; every read resolves names through it."""
        if refresh or self._view is _UNREAD:
            self._view = records.read_record(self)[0]
        return self._view

    def _read_key(self, name: str) -> str:
        if records.is_internal(name):
            return self._key(name)
        return self._key(records.placed(self.committed_version(), name))

    def _reading(self, name: str, what: str, read):
        """``read(key)`` of ``name`` through the record. An object of the committed save is
        removed only once another save committed, or once a tool made the plain names the
        checkpoint (``plain``): a read that misses is tried again where the record, read again,
        places the same save's object; anything else stays the miss (and a load then finds the
        record changed: "replaced ... load again")."""
        key = self._read_key(name)
        try:
            return read(key)
        except Exception as e:  # noqa: BLE001
            failed = classify(e, self.where(name), what)
            view = self._view
            if not isinstance(failed, FileNotFoundError) or view is _UNREAD or view is None:
                raise failed from e
        fresh = self.committed_version(refresh=True)
        again = self._read_key(name)
        if fresh is None or fresh.token != view.token or again == key:
            raise FileNotFoundError(self.where(name))
        try:
            return read(again)
        except Exception as e:  # noqa: BLE001
            self._fail(name, what, e)

    def _written(self) -> None:
        self._view = _UNREAD  # this process changed the prefix: read the record anew

    def get_versioned(self, name: str) -> Tuple[bytes, Dict[str, Any]]:
        try:
            got = obstore.get(self._store, self._key(name))
            data = bytes(got.bytes())
        except Exception as e:  # noqa: BLE001
            self._fail(name, "get", e)
        meta = got.meta
        return data, {"e_tag": meta.get("e_tag"), "version": meta.get("version")}

    def put_versioned(self, name: str, data, expected: Optional[Dict[str, Any]]) -> bool:
        self._written()
        mode: Any = "create"
        if expected is not None:
            mode = {k: v for k, v in expected.items() if v is not None}
        try:
            obstore.put(self._store, self._key(name), owned(data), mode=mode)
            return True
        except (obe.AlreadyExistsError, obe.PreconditionError):
            return False
        except Exception as e:  # noqa: BLE001
            self._fail(name, "versioned put", e, writing=True)

    def copy(self, src: str, dst: str) -> None:
        self._written()
        try:
            obstore.copy(self._store, self._key(src), self._key(dst))
        except Exception as e:  # noqa: BLE001
            self._fail(dst, f"copy from {src}", e)

    # ---------------------------------------------------------------- objects

    def put(self, name: str, data) -> None:
        self._written()
        try:
            obstore.put(
                self._store,
                self._key(name),
                owned(data),
                chunk_size=self.part_size,
                max_concurrency=self.max_concurrency,
            )
        except Exception as e:  # noqa: BLE001
            self._fail(name, "put", e, writing=True)

    def put_if_absent(self, name: str, data) -> bool:
        self._written()
        try:
            obstore.put(self._store, self._key(name), owned(data), mode="create")
            return True
        except obe.AlreadyExistsError:
            return False
        except obe.PreconditionError:
            return False
        except Exception as e:  # noqa: BLE001
            self._fail(name, "conditional put", e, writing=True)

    def get(self, name: str) -> bytes:
        return self._reading(name, "get", lambda key: memoryview(obstore.get(self._store, key).bytes()))

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        wanted = [i for i, n in enumerate(lengths) if n > 0]
        out: List[memoryview] = [memoryview(b"")] * len(starts)
        if not wanted:
            return out

        def ranges(key):
            try:
                return obstore.get_ranges(
                    self._store,
                    key,
                    starts=[starts[i] for i in wanted],
                    lengths=[lengths[i] for i in wanted],
                    coalesce=self.coalesce,
                )
            except Exception as e:  # noqa: BLE001
                answer = parse_answer(e)
                if (
                    answer.status in (None, 416)
                    and "range" in answer.text.lower()
                    and not isinstance(e, obe.NotFoundError)
                ):
                    raise CheckpointingException(
                        f"{self.where(name)}: object is truncated (a needed byte range lies past its end)"
                    ) from None
                raise

        got = self._reading(name, "ranged get", ranges)
        for i, b in zip(wanted, got):
            view = memoryview(b)
            if len(view) != lengths[i]:
                raise CheckpointingException(
                    f"{self.where(name)}: object is truncated (got {len(view)} of {lengths[i]} bytes "
                    f"at offset {starts[i]})"
                )
            out[i] = view
        return out

    def size(self, name: str) -> int:
        return self._reading(name, "head", lambda key: int(obstore.head(self._store, key)["size"]))

    def delete(self, name: str) -> None:
        self._written()
        try:
            obstore.delete(self._store, self._key(name))
        except Exception as e:  # noqa: BLE001
            failed = classify(e, self.where(name), "delete")
            # S3 answers 204 for a missing key; GCS 404 (NoSuchKey), Azure 404 (BlobNotFound).
            if not isinstance(failed, FileNotFoundError):
                raise failed from e

    def list(self, prefix: str = "") -> Dict[str, int]:
        """The checkpoint's objects under ``prefix`` as its commit record shows them: the
        committed save's staged objects under their plain names, and its data files; without a
        record (or a ``plain`` one), every object."""
        view = self.committed_version()
        if view is None or view.state == records.PLAIN:
            return self.list_objects(prefix)
        return records.StagedStore(self, view.token).list(prefix)

    def is_empty(self) -> bool:
        base = self._prefix + "/" if self._prefix else None
        try:
            for batch in obstore.list(self._store, prefix=base, chunk_size=1):
                return not batch
        except Exception as e:  # noqa: BLE001
            self._fail("", "list", e)
        return True

    def list_objects(self, prefix: str = "") -> Dict[str, int]:
        # A listing prefix need not end at a ``/`` (``"optimizer."``); it is checked as a name
        # without its trailing ``/``.
        base = (
            self._key(prefix.rstrip("/"), "listing prefix") + prefix[len(prefix.rstrip("/")) :]
            if prefix
            else (self._prefix + "/" if self._prefix else None)
        )
        try:
            metas = [m for batch in obstore.list(self._store, prefix=base) for m in batch]
        except Exception as e:  # noqa: BLE001
            self._fail(prefix, "list", e)
        cut = len(self._prefix) + 1 if self._prefix else 0
        return dict(sorted((m["path"][cut:], int(m["size"])) for m in metas))

    def open_writer(self, name: str) -> Writer:
        self._written()
        try:
            return _ObjectWriter(self, name)
        except Exception as e:  # noqa: BLE001
            self._fail(name, "open upload", e, writing=True)

    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        """Refuse to write over a committed checkpoint unless ``overwrite=True``; then un-commit
        it first (``metadata.json`` goes before any byte of the new save is written)."""
        marker = commit_names[0]
        if self.exists(marker):
            if not overwrite:
                raise CheckpointingException(
                    f"{self.url} already holds a committed checkpoint ({marker} exists); object "
                    f"stores are never overwritten silently: save elsewhere, remove it, or pass "
                    f"overwrite=True"
                )
        for name in commit_names:
            self.delete(name)

    def commit(self, name: str, data: bytes) -> None:
        if not self.put_if_absent(name, data):
            raise CheckpointingException(
                f"{self.where(name)} appeared while this save was running: another save committed "
                f"to {self.url} concurrently; this save did not commit (its objects may have been "
                f"mixed with the other save's: verify or remove that checkpoint)"
            )


def _config_text(value: Any) -> Any:
    """obstore's store config takes strings: ``True`` -> ``"true"``, ``5`` -> ``"5"``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _positive_int(url: str, opts: Dict[str, Any], key: str, default: int, minimum: int = 1) -> int:
    value = opts.pop(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise CheckpointingException(f"{url}: storage option {key}={value!r} must be an integer >= {minimum}")
    return number


def _aws_profile_provider(profile: Optional[str]):
    """A boto3 credential provider for a named profile, when one is asked for and no static key
    is set in the environment."""
    profile = profile or (os.environ.get("AWS_PROFILE") if "AWS_ACCESS_KEY_ID" not in os.environ else None)
    if not profile:
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise CheckpointingException(
            f"AWS profile {profile!r} requested but boto3 is not installed (pip install boto3), or "
            f"set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        ) from None
    return Boto3CredentialProvider(boto3.Session(profile_name=profile))
