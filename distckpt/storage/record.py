"""The commit record of an object-store checkpoint, and the names an overwrite writes under.

An object store has no rename, so an overwrite cannot build the new checkpoint aside and swap it
in (:mod:`distckpt.commit_store` runs the protocol). Instead the new save writes each of its
objects under a name no other save uses, and one small object, the *commit record*, says which
save is the checkpoint::

    <prefix>/.distckpt_commit.json        the record (below); replaced by versioned puts only
    <prefix>/<token>__R_B.distcp          data files of save <token> (torch_dist), and their block
    <prefix>/<token>__R_B.distcp.crc      tables: these names are final (``.metadata`` records them)
    <prefix>/.distckpt-<token>/<name>     every other object of save <token>, staged: metadata.json,
                                          common.pt, .metadata, the sidecar, the manifest, zarr
                                          nodes and chunks, object files
    <prefix>/<name>                       the published copies of the staged objects (the layout
                                          Megatron-Core, DCP and Zarr readers know)

The record, JSON::

    {"format": "distckpt-commit", "version": 1, "token": "g3-1a2b3c4d", "generation": 3,
     "state": "staged" | "published" | "plain", "save_id": "<the manifest's save id>"}

- ``staged``: the checkpoint is save ``token``; its staged objects are read from
  ``.distckpt-<token>/``, its data files from their own names. Nothing of it is written again.
- ``published``: the same, and the staged objects were also copied to their plain names (for
  readers that know only those); distckpt still reads the staged ones, which no later save
  writes (the plain copies are rewritten by the next overwrite's publication).
- ``plain``: the plain names are the checkpoint (a tool edited it in place, or a save in place
  followed a record); read those.
- no record: a checkpoint saved once to a fresh prefix (or before this protocol): read the plain
  names. A record that names no usable token is damage (an error naming the record).

A *token* is ``g<generation>-<8 hex digits>``: the generation is one more than the record's (0
without one) when the save began, so a cleaner can tell the objects of a save that can still
commit (a newer generation) from those that never will.

:class:`StagedStore` is the store an overwrite's strategies write through: it puts each name
where the table above says and hands ``torch_dist`` the token for its data file names
(:attr:`Store.file_token`). Readers need nothing: :class:`~distckpt.storage.object.ObjectStore`
reads its record once per operation and resolves names through :func:`placed`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from distckpt.core import CheckpointingException
from distckpt.storage.base import Store, Writer

__all__ = [
    "CommitRecord",
    "RECORD_NAME",
    "STAGED",
    "PUBLISHED",
    "PLAIN",
    "PlainView",
    "StagedStore",
    "is_internal",
    "new_token",
    "parse_record",
    "placed",
    "staged_dir",
    "token_in",
]

RECORD_NAME = ".distckpt_commit.json"
STAGED, PUBLISHED, PLAIN = "staged", "published", "plain"
_STAGED_PREFIX = ".distckpt-"
_TOKEN = r"g(?P<gen>\d{1,12})-(?P<hex>[0-9a-f]{8})"
_TOKEN_FULL = re.compile(rf"^{_TOKEN}$")
# A token in a data file's name (``<hint><token>__R_B.distcp[.crc]``) or a staged folder.
_TOKEN_IN_DATA = re.compile(rf"{_TOKEN}__\d+_\d+\.distcp(?:\.crc)?$")
_TOKEN_IN_STAGED = re.compile(rf"^\.distckpt-{_TOKEN}(?:/|$)")
MAX_RECORD_BYTES = 4096


@dataclass(frozen=True)
class CommitRecord:
    """Which save is the checkpoint at a prefix, and whether its objects are published."""

    token: str
    generation: int
    state: str
    save_id: str

    def to_bytes(self) -> bytes:
        return json.dumps({"format": "distckpt-commit", "version": 1, **asdict(self)}).encode()

    def with_state(self, state: str) -> CommitRecord:
        return CommitRecord(self.token, self.generation, state, self.save_id)


def parse_record(raw: bytes, where: str) -> CommitRecord:
    """The record in ``raw`` (read from ``where``), every field checked: it is untrusted input."""
    if len(raw) > MAX_RECORD_BYTES:
        raise CheckpointingException(f"{where}: {len(raw)} bytes, more than a commit record holds")
    try:
        data = json.loads(bytes(raw))
    except ValueError as e:
        raise CheckpointingException(f"{where}: not a commit record (invalid JSON: {e})") from None
    if not isinstance(data, dict) or data.get("format") != "distckpt-commit" or data.get("version") != 1:
        raise CheckpointingException(f"{where}: not a distckpt commit record of version 1")
    token, generation, state, save_id = (data.get(k) for k in ("token", "generation", "state", "save_id"))
    match = _TOKEN_FULL.match(token) if isinstance(token, str) else None
    if match is None:
        raise CheckpointingException(f"{where}: field 'token' {token!r} is not g<generation>-<8 hex digits>")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation != int(match["gen"]):
        raise CheckpointingException(
            f"{where}: field 'generation' {generation!r} does not match the token {token!r}"
        )
    if state not in (STAGED, PUBLISHED, PLAIN):
        raise CheckpointingException(
            f"{where}: field 'state' {state!r} is not one of {STAGED!r}, {PUBLISHED!r}, {PLAIN!r}"
        )
    if not isinstance(save_id, str) or len(save_id) > 64:
        raise CheckpointingException(f"{where}: field 'save_id' {save_id!r} is not a save id")
    return CommitRecord(token, generation, state, save_id)


def new_token(generation: int) -> str:
    return f"g{generation}-{secrets.token_hex(4)}"


def staged_dir(token: str) -> str:
    return f"{_STAGED_PREFIX}{token}"


def is_internal(name: str) -> bool:
    """Names the protocol itself manages: the record and staged objects (never redirected)."""
    return name == RECORD_NAME or name.startswith(_STAGED_PREFIX)


def is_final(token: str, name: str) -> bool:
    """Whether save ``token`` writes ``name`` under its own name (a data file that carries the
    token) rather than staged."""
    return f"{token}__" in name.rsplit("/", 1)[-1]


def placed(record: Optional[CommitRecord], name: str) -> str:
    """The object that holds ``name`` of the checkpoint ``record`` describes."""
    if record is None or record.state == PLAIN or is_internal(name) or is_final(record.token, name):
        return name
    return f"{staged_dir(record.token)}/{name}"


def token_in(name: str) -> Optional[Tuple[str, int]]:
    """``(token, generation)`` of the save an object belongs to by its name, else None."""
    m = _TOKEN_IN_STAGED.match(name) or (_TOKEN_IN_DATA.search(name) if "/" not in name else None)
    if m is None:
        return None
    return f"g{m['gen']}-{m['hex']}", int(m["gen"])


class StagedStore(Store):
    """``inner`` as save ``token`` of an overwrite sees it: each name goes where the module
    docstring's table says (data files carrying the token under their own names, everything else
    below ``.distckpt-<token>/``), reads and writes alike."""

    local_root = None
    direct_root = None

    def __init__(self, inner: Store, token: str):
        self.inner, self.token = inner, token
        self.file_token = token
        self.staged = staged_dir(token)
        self.supports_rename = False
        self.supports_mmap = False
        self.supports_conditional_put = inner.supports_conditional_put
        self.supports_ranged_read = inner.supports_ranged_read

    def name(self, name: str) -> str:
        return name if is_final(self.token, name) else f"{self.staged}/{name}"

    @property
    def url(self) -> str:
        return self.inner.url

    def where(self, name: str) -> str:
        return self.inner.where(self.name(name))

    def child(self, name: str) -> Store:
        raise CheckpointingException(f"{self.url}: a save in progress has no sub-checkpoints ({name})")

    def put(self, name: str, data) -> None:
        self.inner.put(self.name(name), data)

    def put_if_absent(self, name: str, data) -> bool:
        return self.inner.put_if_absent(self.name(name), data)

    def get(self, name: str) -> bytes:
        return self.inner.get(self.name(name))

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        return self.inner.get_ranges(self.name(name), starts, lengths)

    def size(self, name: str) -> int:
        return self.inner.size(self.name(name))

    def delete(self, name: str) -> None:
        self.inner.delete(self.name(name))

    def list(self, prefix: str = "") -> Dict[str, int]:
        cut = len(self.staged) + 1
        found = {n[cut:]: s for n, s in self.inner.list_objects(f"{self.staged}/{prefix}").items()}
        for name, size in self.inner.list_objects(prefix).items():
            if is_final(self.token, name) and "/" not in name:
                found[name] = size
        return dict(sorted(found.items()))

    def open_writer(self, name: str) -> Writer:
        return self.inner.open_writer(self.name(name))

    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        raise CheckpointingException(f"{self.url}: a save in progress cannot begin another")

    def commit(self, name: str, data: bytes) -> None:
        raise CheckpointingException(f"{self.url}: a staged save is committed by its record")


class PlainView(StagedStore):
    """``store`` by its plain names whatever its record says (what other readers see there); for
    reading what is published, e.g. the manifest a publication replaces."""

    def __init__(self, store: Store):
        super().__init__(store, "-")
        self.file_token = None

    def name(self, name: str) -> str:
        return name

    def get(self, name: str) -> bytes:
        return self.inner.get_versioned(name)[0]


def read_record(store: Store) -> Tuple[Optional[CommitRecord], Any]:
    """``(record, version)`` of ``store``'s :data:`RECORD_NAME`; ``(None, None)`` when there is
    none."""
    try:
        raw, version = store.get_versioned(RECORD_NAME)
    except FileNotFoundError:
        return None, None
    return parse_record(raw, store.where(RECORD_NAME)), version
