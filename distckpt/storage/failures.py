"""Object-store failures, classified: what went wrong, on which remote, and whether to try again.

obstore (Rust ``object_store``) raises one exception type per *kind* of answer it understood —
``NotFoundError`` (404), ``PermissionDeniedError`` (403), ``UnauthenticatedError`` (401),
``PreconditionError`` (412), ``AlreadyExistsError`` (409, or 412 on a create) — and
``GenericError`` for everything else: throttling (429, 503 ``SlowDown``), other 5xx, requests
that never got an answer (connection refused or reset, timeouts). Its streaming writer reports
the same through Python's ``OSError`` family (``PermissionError``, ``FileNotFoundError``,
``OSError``). Each message carries the request (``Error performing PUT http://...``) and, when the
server answered, its status and body: for S3, GCS (XML API) and Azure an XML ``<Error>`` with the
server's ``<Code>`` and ``<Message>``.

:func:`classify` turns any of them into one of:

=========================  ==========================================================  =========
class                      when                                                        transient
=========================  ==========================================================  =========
``FileNotFoundError``      an object that is not there (GET/HEAD 404, ``NoSuchKey``,   no
                           ``BlobNotFound``): callers treat it as "absent"
:class:`BucketNotFoundError`  the bucket / container itself is missing (``NoSuchBucket``,  no
                           ``ContainerNotFound``; any 404 on a write: a PUT creates
                           its object, so only the bucket can be missing)
:class:`AccessDeniedError`  401/403, bad or expired credentials, a policy that refuses  no
:class:`ThrottledError`    429, 503 ``SlowDown``/``ServerBusy``/``TooManyRequests``     yes
:class:`UnavailableError`  other 5xx (not 501, 505), 408, and requests without an     yes
                           answer (connection refused/reset, timeouts, DNS)
:class:`RequestRefusedError`  any other answer (400 ``InvalidRequest``, 416 ...)         no
=========================  ==========================================================  =========

obstore has already retried the transient ones (``retry_config``: exponential backoff with
jitter, bounded in count and time) before they reach distckpt; the ``transient`` attribute tells
a caller with a longer horizon (the tiered upload, which retries a file later) whether another
try can help. Type first: the class obstore raised decides where it is specific (not found,
permission, precondition); the status and the server's code, read from the message, decide
within ``GenericError`` and tell a missing bucket from a missing object (both are 404
``NotFoundError``). Every message names the remote object and keeps the server's code and message
whole, plus the request that failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from obstore import exceptions as obe

from distckpt.core import CheckpointingException

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "RequestRefusedError",
    "ServerAnswer",
    "StoreError",
    "ThrottledError",
    "UnavailableError",
    "classify",
    "is_transient",
    "parse_answer",
]

_REQUEST = re.compile(r"Error performing (?P<method>[A-Z]+) (?P<uri>\S+)")
_STATUS = re.compile(r"status code: (?P<status>\d{3})|status: (?P<debug>\d{3})")
_CODE = re.compile(r"<Code>\s*([^<]+?)\s*</Code>")
_MESSAGE = re.compile(r"<Message>\s*([^<]*?)\s*</Message>", re.S)
_RETRIES = re.compile(r"after (\d+) retries")
_XML = re.compile(r"<\?xml.*?</Error>|<Error>.*?</Error>", re.S)

BUCKET_MISSING = frozenset({"NoSuchBucket", "ContainerNotFound", "BucketNotFound", "ContainerBeingDeleted"})
OBJECT_MISSING = frozenset({"NoSuchKey", "BlobNotFound", "NotFound"})
ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
    }
)
THROTTLE_CODES = frozenset(
    {"SlowDown", "ServerBusy", "TooManyRequests", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
)
# Words of a request that never got an answer (hyper / reqwest / the OS).
_NO_ANSWER = (
    "error sending request",
    "connection refused",
    "connection reset",
    "connection closed",
    "broken pipe",
    "timed out",
    "timeout",
    "dns error",
    "failed to lookup address",
    "incomplete message",
    "unexpected eof",
    "end of file before message length reached",
)


@dataclass(frozen=True)
class ServerAnswer:
    """What one failed request was and what the server said, as far as the message tells."""

    request: Optional[str]  # "PUT http://host/bucket/key"
    status: Optional[int]
    code: Optional[str]
    message: Optional[str]
    retries: Optional[int]
    text: str  # obstore's message without its debug dump, the XML body folded to code: message

    def answer(self) -> str:
        """``503 SlowDown: Please reduce your request rate.`` (what is known of it)."""
        parts = [str(self.status) if self.status else "", self.code or ""]
        head = " ".join(p for p in parts if p)
        if self.message:
            return f"{head}: {self.message}" if head else self.message
        return head


def parse_answer(e: BaseException) -> ServerAnswer:
    """The request, status, the server's code and message, and the retry count in ``e``'s text."""
    full = str(e)
    text = full.split("\nDebug source:", 1)[0].strip()
    request = _REQUEST.search(full)
    status = _STATUS.search(full)
    code = _CODE.search(full)
    message = _MESSAGE.search(full)
    retries = _RETRIES.search(full)
    folded = _XML.sub(lambda _: "", text).rstrip(": \n")
    return ServerAnswer(
        request=f"{request['method']} {request['uri']}" if request else None,
        status=int(status["status"] or status["debug"]) if status else None,
        code=code.group(1) if code else None,
        message=" ".join(message.group(1).split()) if message else None,
        retries=int(retries.group(1)) if retries else None,
        text=" ".join(folded.split()),
    )


class StoreError(CheckpointingException):
    """An object-store request failed (see the module docstring for the subclasses).

    ``where``: the remote object (URL); ``operation``: what distckpt was doing (``put``,
    ``upload``, ``get`` ...); ``answer``: the request and the server's answer."""

    transient = False
    reason = "the request failed"

    def __init__(self, where: str, operation: str, answer: ServerAnswer, note: str = ""):
        self.where, self.operation, self.answer = where, operation, answer
        said = answer.answer()
        if said:
            said = f"the server answered {said}"
        else:
            said = answer.text or "no answer"
        request = f" [{answer.request}]" if answer.request else ""
        retried = f", still after {answer.retries} retries" if answer.retries else ""
        super().__init__(f"{where}: {operation} failed: {self.reason}{retried} ({said}){request}{note}")


class BucketNotFoundError(StoreError):
    """The bucket or container does not exist (or the endpoint/account names another one)."""

    reason = "the bucket or container does not exist (check its name, the endpoint and the region)"


class AccessDeniedError(StoreError):
    """Authentication failed or the credentials may not do this (401/403)."""

    reason = "access denied (check the credentials, their expiry and the bucket's policy)"


class ThrottledError(StoreError):
    """The store asked to slow down (429, 503 SlowDown) beyond obstore's retries."""

    transient = True
    reason = "the store is throttling requests (slow down, or raise retry_config's limits)"


class UnavailableError(StoreError):
    """The store did not answer, or answered a server error (5xx, 408), beyond obstore's retries."""

    transient = True
    reason = "the store could not be reached or failed (a transient error)"


class RequestRefusedError(StoreError):
    """The store refused the request for another reason (400, 416, ...)."""

    reason = "the store refused the request"


def is_transient(e: BaseException) -> bool:
    """Whether another try of the same request may succeed later."""
    return bool(getattr(e, "transient", False))


def classify(e: BaseException, where: str, operation: str, writing: bool = False) -> BaseException:
    """The exception to raise for ``e``, an error of a request for ``where`` (the remote
    object). ``writing``: the request creates the object (PUT, multipart), so a 404 can only
    mean a missing bucket. A CheckpointingException (a name the containment rule refused, an
    error already classified) comes back unchanged."""
    if isinstance(e, CheckpointingException):
        return e
    answer = parse_answer(e)
    code, status = answer.code, answer.status
    if code in BUCKET_MISSING:
        return BucketNotFoundError(where, operation, answer)
    if isinstance(e, (obe.NotFoundError, FileNotFoundError)) or status == 404:
        if writing and code not in OBJECT_MISSING:
            return BucketNotFoundError(where, operation, answer)
        if code == "NoSuchUpload":
            return UnavailableError(where, operation, answer, "; the multipart upload was removed meanwhile")
        missing = FileNotFoundError(where)
        missing.answer = answer
        return missing
    if (
        isinstance(e, (obe.PermissionDeniedError, obe.UnauthenticatedError, PermissionError))
        or status in (401, 403)
        or code in ACCESS_CODES
    ):
        return AccessDeniedError(where, operation, answer)
    if status == 429 or code in THROTTLE_CODES:
        return ThrottledError(where, operation, answer)
    # 501 Not Implemented and 505 HTTP Version Not Supported say the server will never do it.
    if (status is not None and (status >= 500 or status == 408) and status not in (501, 505)) or (
        status is None and any(w in answer.text.lower() for w in _NO_ANSWER)
    ):
        return UnavailableError(where, operation, answer)
    if status is not None:
        return RequestRefusedError(where, operation, answer)
    return StoreError(where, operation, answer)
