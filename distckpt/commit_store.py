"""How a save becomes the checkpoint at an object-store prefix: no window, whatever is cut.

An object store has no rename; what it has are atomic puts of single objects, versioned puts
(``If-Match`` on S3 and Azure, a generation match on GCS; ``supports_versioned_put``) and
server-side copies. :class:`StoreCommit` builds the commit on them. The names and the commit
record are :mod:`distckpt.storage.record`'s; the ranks named are those that call each step
(``distckpt.saving.save`` is the caller, as for :class:`distckpt.commit.RenameCommit`).

**A fresh prefix** (no committed checkpoint there): written in place, as always. ``begin``
(rank 0) deletes stale commit files of an earlier save that never committed; every rank writes
its objects under their plain names; ``commit`` (rank 0, after every rank finished) writes
``metadata.json`` with a conditional create (``If-None-Match: *``), which is the commit and the
arbiter between two saves racing to one prefix. A crash before it leaves objects without
``metadata.json``: never a checkpoint, and the prefix is still fresh for the next save.

**An overwrite** (``overwrite=True`` over a committed checkpoint):

1. ``begin`` (rank 0): read the commit record and its version (none: generation 0), pick a token
   ``g<generation+1>-<hex>``. Nothing is written or deleted.
2. Every rank writes through a :class:`~distckpt.storage.record.StagedStore`: ``torch_dist`` data
   files under names carrying the token (``<token>__R_B.distcp``, recorded as such in
   ``.metadata``), everything else below ``.distckpt-<token>/``. Not one object of the checkpoint
   being replaced is touched.
3. ``commit`` (rank 0): ``metadata.json`` into the staged tree; one listing checks that every
   object the new manifest lists is there with its size; then the record is replaced by a
   versioned put (a create if there was none) naming the new token, state ``staged``. **That put
   is the commit**: before it every reader sees the old checkpoint, after it the new one. If the
   record changed since ``begin`` (another save committed), the put fails and so does this save.
4. ``after_commit`` (rank 0, after the ranks agreed, best effort): *publish* — server-side copies
   of the staged objects to their plain names (``metadata.json`` last), deletion of the plain
   names the replaced checkpoint had and this one has not, the record marked ``published`` —
   then *collect garbage*: the objects of every earlier save and of saves that can no longer
   commit (:func:`collect_garbage`).

Readers (every rank of a load, every query and tool) read the record once per operation and
resolve every name through it (``ObjectStore.committed_version``): the staged tree of the
committed save and its token-named data files, which no later save writes again and which are
deleted only once another save has committed. So a reader sees the old checkpoint or the new
one whole; one whose objects were collected mid-read (a load racing an overwrite) finds the
record changed and raises "replaced ... load again" instead of returning a mix
(:func:`distckpt.commit.check_unchanged`). The plain names are for other readers (Megatron-Core
after a download, PyTorch DCP's fsspec reader, Zarr readers): they follow the committed save once
it is published; during a publish, or after one cut short, they may mix two saves until the next
save or ``distckpt gc`` publishes again.

A crash or an outage at any point: before the record's put, the old checkpoint is intact and the
new objects are garbage; after it, the new checkpoint is complete (its staged tree) whatever is
left of the publication. Costs: the staged objects are stored twice (staged and published; for
``torch_dist`` only the small files, for ``zarr`` every chunk), and an overwrite adds one
listing, one copy per staged object, two record puts and the deletions.

Stores without versioned puts (the tiered save's local store) keep the in-place protocol of
``Store.begin_save`` / ``Store.commit``.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Set

from distckpt.core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException
from distckpt.formats.manifest import MANIFEST_FNAME, read_manifest, read_manifest_files
from distckpt.storage.base import Store
from distckpt.storage.record import (
    PLAIN,
    PUBLISHED,
    RECORD_NAME,
    STAGED,
    CommitRecord,
    PlainView,
    StagedStore,
    new_token,
    read_record,
    staged_dir,
    token_in,
)

__all__ = [
    "COMMIT_NAMES",
    "StoreCommit",
    "StoreStaging",
    "collect_garbage",
    "flatten",
    "publish",
]

logger = logging.getLogger(__name__)

# The names whose presence makes a location look like a checkpoint (the commit marker first).
# The sidecar index goes too: a stale one must never outlive the .metadata it describes.
COMMIT_NAMES = (CONFIG_FNAME, ".metadata", MANIFEST_FNAME, ".distckpt_index")
COPY_THREADS = 16


@dataclass(frozen=True)
class StoreStaging:
    """One save to an object store in progress (rank 0 broadcasts it): ``token`` None means in
    place (a fresh prefix, or a store without versioned puts); ``expected`` is the record's
    version when the save began (None: there was none)."""

    save_id: str
    token: Optional[str]
    generation: int
    expected: Any
    versioned: bool
    target: None = None
    path: None = None


class StoreCommit:
    """The object-store commit (module docstring). Bound to its store; rank 0 calls ``begin``,
    ``commit``, ``after_commit`` and ``abort``; every rank calls ``where``."""

    def __init__(self, store: Store):
        self.store = store
        self._kept: Set[str] = set()  # saves whose commit may have landed: never aborted

    def where(self, staging: StoreStaging) -> Store:
        """Every rank: the store the strategies write through."""
        if staging.token is None:
            return self.store
        return StagedStore(self.store, staging.token)

    def begin(self, target: Store, save_id: str, overwrite: Optional[bool] = None) -> StoreStaging:
        if not target.supports_versioned_put:
            target.begin_save(COMMIT_NAMES, overwrite)
            return StoreStaging(save_id, None, 0, None, False)
        record, version = read_record(target)
        target.committed_version(refresh=True)
        generation = (record.generation if record is not None else 0) + 1
        if target.exists(CONFIG_FNAME):
            if not overwrite:
                raise CheckpointingException(
                    f"{target.url} already holds a committed checkpoint ({CONFIG_FNAME} exists); object "
                    f"stores are never overwritten silently: save elsewhere, remove it, or pass "
                    f"overwrite=True"
                )
            return StoreStaging(save_id, new_token(generation), generation, version, True)
        # Nothing committed: in place. A record left by an earlier save that never committed
        # keeps counting generations but now names the plain objects this save writes.
        if record is not None:
            fresh = CommitRecord(new_token(generation), generation, PLAIN, save_id)
            if not target.put_versioned(RECORD_NAME, fresh.to_bytes(), version):
                raise CheckpointingException(
                    f"{target.url}: another save changed the commit record while this one began"
                )
        for name in COMMIT_NAMES[1:]:
            target.delete(name)
        return StoreStaging(save_id, None, generation, None, True)

    def commit(self, staging: StoreStaging, config: CheckpointingConfig) -> None:
        """rank 0, after every rank finished writing: the commit (see the module docstring)."""
        data = json.dumps(asdict(config)).encode()
        if not staging.versioned:
            self.store.commit(CONFIG_FNAME, data)
            return
        if staging.token is None:
            try:
                self.store.commit(CONFIG_FNAME, data)
            except CheckpointingException:
                if not _ours(self.store, staging):
                    raise
            return
        staged = StagedStore(self.store, staging.token)
        staged.put(CONFIG_FNAME, data)
        _check_complete(self.store, staged)
        record = CommitRecord(staging.token, staging.generation, STAGED, staging.save_id)
        try:
            done = self.store.put_versioned(RECORD_NAME, record.to_bytes(), staging.expected)
        except Exception:
            # The put may have landed with its answer lost. Unless the record can be read and
            # names another save, this save's objects may be the checkpoint now: abort keeps them
            # (the clean-up of a later save decides by generation).
            try:
                current = read_record(self.store)[0]
            except Exception:  # noqa: BLE001 - the put's own error is the one to report
                current = None
                self._kept.add(staging.token)
            if current is not None and current.token == staging.token:
                return
            raise
        if not done:
            current, _ = read_record(self.store)
            if current is None or current.token != staging.token:  # not our own put, retried
                now = current.token if current is not None else "none"
                raise CheckpointingException(
                    f"{self.store.where(RECORD_NAME)} changed while this save was running: another save "
                    f"committed to {self.store.url} concurrently (now {now}); this save did not commit, "
                    f"and the checkpoint there is the other save's, whole"
                )

    def after_commit(self, staging: StoreStaging) -> None:
        """rank 0, once the save is committed: publish it and collect garbage (best effort: a
        failure is logged; the checkpoint stands, and the next save or ``distckpt gc`` finishes)."""
        if not staging.versioned or (staging.token is None and staging.generation == 1):
            return  # a first save to a fresh prefix: no earlier save's objects to remove
        try:
            if staging.token is not None:
                publish(self.store)
            collect_garbage(self.store)
        except Exception as e:  # noqa: BLE001
            logger.warning(
                "%s: the save is committed, but publishing it or removing the objects of earlier saves "
                "failed (%s); the next save or `distckpt gc %s` finishes that",
                self.store.url,
                e,
                self.store.url,
            )

    def abort(self, staging: StoreStaging) -> None:
        """rank 0, best effort: remove the objects of a failed overwrite (its staged tree and its
        data files). A failed save in place leaves its objects uncommitted; the next save to the
        prefix writes over them."""
        if staging.token is None or staging.token in self._kept:
            return
        try:
            _delete(self.store, [n for n in self.store.list_objects() if _token_of(n) == staging.token])
        except Exception as e:  # noqa: BLE001
            logger.warning(
                "%s: could not remove the objects of a failed save (%s); the next save or `distckpt gc` "
                "removes them",
                self.store.url,
                e,
            )

    def cleanup_leftovers(self, target: Store) -> list:
        return []

    def recover(self, target: Store) -> bool:
        """Any rank, before reading: read the commit record again (this operation's view)."""
        target.committed_version(refresh=True)
        return False


def _ours(store: Store, staging: StoreStaging) -> bool:
    """Whether ``metadata.json`` is there because of this very save (its first put succeeded but
    the answer was lost, and the client's retry met the object): the manifest beside it carries
    this save's id."""
    try:
        manifest = read_manifest(store)
        return manifest is not None and manifest.save_id == staging.save_id and store.exists(CONFIG_FNAME)
    except Exception:  # noqa: BLE001 - cannot tell: the commit's own error stands
        return False


def _token_of(name: str) -> Optional[str]:
    found = token_in(name)
    return found[0] if found else None


def _check_complete(store: Store, staged: StagedStore) -> None:
    """Every object the staged manifest lists is there with its size (one listing)."""
    files = read_manifest_files(staged)
    if not files:
        return
    listing = store.list_objects()
    for name, size in files.items():
        actual = listing.get(staged.name(name))
        if actual is None:
            raise CheckpointingException(
                f"{staged.where(name)}: missing at commit (removed by another job's clean-up?); nothing "
                f"was committed"
            )
        if actual != size:
            raise CheckpointingException(
                f"{staged.where(name)}: {actual} bytes at commit, the manifest says {size}; nothing was "
                f"committed"
            )


def _delete(store: Store, names: List[str]) -> None:
    if not names:
        return
    with ThreadPoolExecutor(min(COPY_THREADS, len(names))) as pool:
        list(pool.map(store.delete, names))


def publish(store: Store) -> Optional[CommitRecord]:
    """Copy the committed save's staged objects to their plain names, remove the plain names of
    the checkpoint it replaced that it does not have, and mark the record ``published``. Does
    nothing when the record is not ``staged``. Returns the record as it is afterwards."""
    record, version = read_record(store)
    if record is None or record.state != STAGED:
        return record
    prefix = staged_dir(record.token) + "/"
    names = sorted(n[len(prefix) :] for n in store.list_objects(prefix))
    # What the replaced checkpoint published and this one lacks goes first: until the manifest
    # is copied over, the plain manifest still names it, so a publication cut short and run again
    # still finds it.
    _delete(store, sorted(_previous_plain(store) - set(names) - {RECORD_NAME}))
    last = [n for n in (MANIFEST_FNAME, CONFIG_FNAME) if n in names]
    order = [n for n in names if n not in last]
    with ThreadPoolExecutor(max(1, min(COPY_THREADS, len(order)))) as pool:
        list(pool.map(lambda n: store.copy(prefix + n, n), order))
    for name in last:
        store.copy(prefix + name, name)
    done = record.with_state(PUBLISHED)
    if not store.put_versioned(RECORD_NAME, done.to_bytes(), version):
        return read_record(store)[0]  # another save committed meanwhile: it publishes its own
    return done


def _previous_plain(store: Store) -> Set[str]:
    """The plain names published before: those of the plain-layout manifest still in place."""
    try:
        files = read_manifest_files(PlainView(store)) or {}
    except (FileNotFoundError, CheckpointingException):
        files = {}
    return {n for n in set(files) | set(COMMIT_NAMES) | {"common.pt"} if not _token_of(n)}


def flatten(store: Store) -> None:
    """Make the plain names the checkpoint (publish first), for tools that edit a checkpoint in
    place: afterwards reads and writes both address the plain names; the staged tree is garbage."""
    if not store.supports_versioned_put:
        return
    record = publish(store)
    if record is None or record.state == PLAIN:
        return
    _, version = read_record(store)
    if not store.put_versioned(RECORD_NAME, record.with_state(PLAIN).to_bytes(), version):
        raise CheckpointingException(
            f"{store.url}: another save committed while the checkpoint was being edited"
        )
    collect_garbage(store)  # the staged tree: a reader still on it falls back to the plain names


def collect_garbage(store: Store, dry_run: bool = False, uncommitted: bool = False) -> List[str]:
    """Remove the objects of saves that are not the committed checkpoint and can never become it:
    saves of an earlier generation than the record's, and of the same generation under another
    token (they began before the committed save and their versioned put must fail). Objects of a
    later generation belong to a save that may still be running and are kept, unless
    ``uncommitted`` (the caller knows no save is running). Plain names are never removed here
    (:func:`publish` keeps them in step). Returns the names removed (or, ``dry_run``, that would be)."""
    record, _ = read_record(store) if store.supports_versioned_put else (None, None)
    current = record.generation if record is not None else 0
    live = record.token if record is not None and record.state != PLAIN else None
    doomed = []
    for name in store.list_objects():
        found = token_in(name)
        if found is None or found[0] == live:
            continue
        token, generation = found
        if record is not None and record.state == PLAIN and token == record.token and "/" not in name:
            continue  # data files the plain checkpoint still names
        if generation <= current or uncommitted:
            doomed.append(name)
    if doomed and not dry_run:
        _delete(store, doomed)
        logger.info("%s: removed %d object(s) of earlier or failed saves", store.url, len(doomed))
    return doomed
