"""Two-tier checkpoints: save at local speed, persist to a remote store in the background,
restart from the nearest copy. See docs/tiered.md for the protocol and its guarantees.

Every rank of the default process group constructs one :class:`TieredCheckpointManager` and
calls its methods at the same points (each may run collectives)::

    tiers = TieredCheckpointManager("s3://bucket/run7", "/local_nvme/run7", keep_local=2, keep_remote=5)
    tiers.save(model.sharded_state_dict(), iteration)   # returns at local speed; uploads in the background
    ...
    tiers.finalize()                                    # any step: commits finished uploads remotely
    state = tiers.load(model.sharded_state_dict())      # newest complete iteration, nearest copy per file
    tiers.close()                                       # at exit: waits for the uploads, commits them

Layout: ``<remote>/iter_0000100/`` is an ordinary distckpt checkpoint (loadable by
``distckpt.load`` and Megatron-Core alike) once committed; ``<local>/iter_0000100/`` holds, on
each node, the files its ranks wrote (plus replicas of peers' files with
``replication_factor`` > 1) and their markers (:mod:`distckpt.tiered.markers`).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from distckpt import containment, dist, storage, timings
from distckpt.commit_store import COMMIT_NAMES
from distckpt.core import CONFIG_FNAME, CheckpointingException, PathLike
from distckpt.formats.manifest import read_manifest
from distckpt.storage.base import Store
from distckpt.storage.local import LocalStore
from distckpt.tiered import markers, replicate, retention
from distckpt.tiered.markers import Marker, iteration_name
from distckpt.tiered.stores import ReadTier, SaveTier
from distckpt.tiered.upload import DONE, FAILED, Upload

logger = logging.getLogger(__name__)

TOKEN_NAME = ".distckpt_tier.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"


class UploadFailedError(CheckpointingException):
    """A background upload failed (raised on every rank, at the next save, finalize or close).
    The local copy is kept; the remote's newest checkpoint is still the one before."""


class NoCheckpointError(CheckpointingException):
    """Neither tier holds a checkpoint that can be loaded (raised on every rank alike)."""


@dataclass
class TierLoadReport:
    """Where one load read its files from (this rank)."""

    iteration: int
    files: Dict[str, str] = field(default_factory=dict)
    local_bytes: int = 0
    remote_bytes: int = 0
    rejected: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        local = sum(1 for s in self.files.values() if s == "local")
        text = (
            f"iteration {self.iteration}: {local} files ({self.local_bytes} bytes) from the local copy, "
            f"{len(self.files) - local} ({self.remote_bytes} bytes) from the remote"
        )
        if self.rejected:
            text += "; local copies not used: " + "; ".join(self.rejected.values())
        return text


class TieredCheckpointManager:
    """Checkpoints written to a node-local tier first and uploaded to a remote tier in the
    background (see the module docstring).

    Args:
        remote: the persistent tier: an object store URL (``s3://bucket/run``) or any location
            ``distckpt.save`` takes; checkpoints go to ``<remote>/iter_NNNNNNN``.
        local: this rank's node-local directory (ranks of a node may share it).
        keep_local: local copies kept per rank (at least 1); older ones are removed once their
            upload is committed. A copy whose upload is not committed is never removed.
        keep_remote: committed checkpoints kept on the remote (None: all). The newest committed
            one is never removed.
        storage_options: options of the remote store (endpoint, credentials ...).
        replication_factor: copies of each rank's local files on peers in other nodes, own
            included (1: none). A replica lets the upload be finished after a node is lost.
        node_size: ranks per node (default ``$LOCAL_WORLD_SIZE`` or 1); ``replication_jump``:
            distance between the members of a replication clique (default ``node_size``).
        upload_threads: files uploaded at once per rank. ``upload_retries`` and
            ``upload_backoff_s``: each file's retries after a failure, the first after about
            ``upload_backoff_s`` seconds, doubling.
        max_pending_uploads: uploads in flight before ``save`` waits for the oldest to end.
    """

    def __init__(
        self,
        remote: storage.Location,
        local: PathLike,
        *,
        keep_local: int = 2,
        keep_remote: Optional[int] = None,
        storage_options: Optional[Dict[str, Any]] = None,
        replication_factor: int = 1,
        node_size: Optional[int] = None,
        replication_jump: Optional[int] = None,
        upload_threads: int = 4,
        upload_retries: int = 5,
        upload_backoff_s: float = 1.0,
        max_pending_uploads: int = 2,
    ):
        if keep_local < 1 or (keep_remote is not None and keep_remote < 1):
            raise CheckpointingException(
                f"keep_local ({keep_local}) and keep_remote ({keep_remote}) must be at least 1: the "
                f"newest checkpoint of a tier is never removed"
            )
        self.remote: Store = storage.open_store(remote, storage_options)
        self.local_root = Path(local)
        self.local_root.mkdir(parents=True, exist_ok=True)
        self.keep_local, self.keep_remote = keep_local, keep_remote
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.replication = replicate.cliques(replication_factor, node_size, replication_jump, self.world)
        self.upload_options = dict(threads=upload_threads, retries=upload_retries, backoff_s=upload_backoff_s)
        self.max_pending = max(1, max_pending_uploads)
        # One id per manager, the same on every rank: it tells this run's saves from any other.
        self._run = dist.broadcast_object(
            uuid.uuid4().hex if self.rank == 0 else None, stage="tiered manager"
        )
        self._count = 0
        self._pending: Dict[int, Tuple[Upload, str]] = {}
        self.last_load: Optional[TierLoadReport] = None
        self.last_commits: List[int] = []

    # ------------------------------------------------------------------ names

    def remote_of(self, iteration: int) -> Store:
        return self.remote.child(iteration_name(iteration))

    def local_of(self, iteration: int) -> Path:
        return containment.path_beneath(self.local_root, iteration_name(iteration), self.local_root, "folder")

    # ------------------------------------------------------------------ save

    def save(
        self,
        sharded_state_dict,
        iteration: int,
        *,
        async_sharded_save: bool = False,
        overwrite: Optional[bool] = None,
        **save_kwargs,
    ):
        """Save ``iteration`` to the local tier (every rank), then upload it in the background.

        Returns None, or with ``async_sharded_save`` the ``AsyncRequest`` to schedule on an
        ``AsyncCallsQueue`` (the upload starts when it is finalized). First finalizes earlier
        uploads that are done (and raises :class:`UploadFailedError` on every rank for one that
        failed); waits while ``max_pending_uploads`` are in flight. ``save_kwargs`` go to
        ``distckpt.save`` (``sharded_strategy``, ``validate_access_integrity`` ...).
        """
        from distckpt.saving import save

        tier, token = self._local_tier(iteration)
        result = save(
            sharded_state_dict,
            tier,
            async_sharded_save=async_sharded_save,
            overwrite=overwrite,
            **save_kwargs,
        )
        if async_sharded_save:
            result.add_finalize_fn(lambda: self._after_local_commit(iteration, tier, token))
            return result
        self._after_local_commit(iteration, tier, token)
        return None

    def save_dcp(self, state_dict, iteration: int, *, planner=None, overwrite: Optional[bool] = None) -> None:
        """:meth:`save` for PyTorch DCP users: ``dcp.save(state_dict, planner=planner)`` of
        ``iteration`` (DCP's state dicts: DTensors, FSDP2's ``get_state_dict``, ``Stateful``
        objects) to the local tier through :class:`distckpt.dcp.StorageWriter`, then uploaded in
        the background like any tiered save. Every rank. Synchronous: the upload and its
        bookkeeping start on the calling thread once the local copy is committed."""
        import torch.distributed.checkpoint as dcp

        from distckpt.dcp import StorageWriter

        tier, token = self._local_tier(iteration)
        # Each node's tier is its own local directory: the ranks know the save by its remote URL.
        writer = StorageWriter(tier, overwrite=overwrite, save_name=tier.remote.url)
        dcp.save(state_dict, storage_writer=writer, planner=planner)
        self._after_local_commit(iteration, tier, token)

    def _local_tier(self, iteration: int) -> Tuple[SaveTier, str]:
        """Every rank, before a save of ``iteration``: earlier uploads finalized (waiting while
        too many are in flight), its local directory's stale markers removed; the store the save
        writes to and the save's token."""
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise CheckpointingException(f"iteration must be a non-negative int, got {iteration!r}")
        self.finalize(blocking=len(self._pending) >= self.max_pending)
        if iteration in self._pending:
            self.finalize(blocking=True)
        directory = self.local_of(iteration)
        # A marker of an earlier save of this iteration must not vouch for files being replaced.
        markers.remove_markers(directory, markers.owners_in(directory) if directory.is_dir() else [])
        token = f"{self._run}-{self._count}"
        self._count += 1
        return SaveTier(LocalStore(directory), self.remote_of(iteration)), token

    def _after_local_commit(self, iteration: int, tier: SaveTier, token: str) -> None:
        """Every rank, once the local save is committed: marker, replicas, start the upload."""
        directory = self.local_of(iteration)
        names = tier.written
        marker, exc = None, None
        try:
            marker = Marker(token, iteration, self.world, self.rank, {n: tier.local.size(n) for n in names})
            markers.write_marker(directory, marker)
        except Exception as e:  # noqa: BLE001 - one rank's full disk fails the save on every rank
            exc = e
        if self.replication is not None:
            dist.sync_errors("tiered save (marker)", exc)
            replicate.replicate(directory, marker, self.replication)
        elif exc is not None:
            # No collective here (it would cost every save a round trip): the upload counts as
            # failed, and the next finalize reports it on every rank.
            failed = Upload(iteration, directory, self.remote_of(iteration), [])
            failed.state, failed.error = FAILED, exc
            self._pending[iteration] = (failed, token)
            return
        upload = Upload(
            iteration,
            directory,
            self.remote_of(iteration),
            [n for n in names if n != CONFIG_FNAME],
            # The token goes up first: a load tells this save's local copies from others by it.
            first={TOKEN_NAME: marker_token_json(token)} if self.rank == 0 else None,
            stale=[n for n in COMMIT_NAMES if n not in names] if self.rank == 0 else (),
            **self.upload_options,
        ).start()
        self._pending[iteration] = (upload, token)

    # ------------------------------------------------------------------ finalize

    def finalize(self, blocking: bool = False) -> List[int]:
        """Every rank: commit remotely each iteration whose upload every rank finished, apply the
        retention rules, and raise :class:`UploadFailedError` (every rank) for an upload that
        failed on any rank. ``blocking``: wait for every upload first. Returns the iterations
        committed by this call."""
        # Every rank holds the same pending iterations (the same saves, the same verdicts), so
        # an empty set needs no collective: a training loop may call this every step for free.
        if not self._pending:
            return []
        if blocking:
            for upload, _ in self._pending.values():
                upload.wait()
        status = {
            it: (up.state, None if up.error is None else f"{type(up.error).__name__}: {up.error}")
            for it, (up, _) in self._pending.items()
        }
        outcome, newest = dist.gather_and_decide("tiered finalize", None, status, self._decide)
        committed, failures = [], []
        for it, (verdict, message) in sorted(outcome.items()):
            if verdict == "committed":
                committed.append(it)
                self._pending.pop(it, None)
            elif verdict == "failed":
                failures.append(message)
                self._pending.pop(it, None)
        self.last_commits = committed
        if committed:
            retention.trim_local(self.local_root, self.keep_local, self._holds(), newest, set(self._pending))
        if failures:
            raise UploadFailedError(" | ".join(failures))
        return committed

    def _holds(self) -> List[int]:
        """The owners whose local files this rank keeps: itself and its clique's."""
        return list(self.replication.clique_of(self.rank)) if self.replication is not None else [self.rank]

    def _decide(self, statuses: List[Dict[int, Tuple[int, Optional[str]]]]) -> Tuple[dict, Optional[int]]:
        """Rank 0: the verdict on each pending iteration, committing those every rank uploaded;
        and the newest committed iteration on the remote."""
        out: Dict[int, Tuple[str, str]] = {}
        for it in sorted(set().union(*statuses)):
            per_rank = [s.get(it, (FAILED, "no upload of this iteration on this rank")) for s in statuses]
            failed = [(r, msg) for r, (state, msg) in enumerate(per_rank) if state == FAILED]
            if failed:
                out[it] = ("failed", self._failure_text(it, failed))
            elif all(state == DONE for state, _ in per_rank):
                try:
                    self._commit_remote(it)
                    out[it] = ("committed", "")
                except Exception as e:  # noqa: BLE001 - reported to every rank
                    out[it] = ("failed", self._failure_text(it, [(0, f"{type(e).__name__}: {e}")]))
            else:
                out[it] = ("pending", "")
        newest = None
        if any(v == "committed" for v, _ in out.values()):
            newest = self._after_commits({i for i, (v, _) in out.items() if v == "pending"})
        return out, newest

    def _failure_text(self, iteration: int, failed: List[Tuple[int, str]]) -> str:
        where = "; ".join(f"rank {r}: {msg}" for r, msg in failed[:8])
        more = f" (and {len(failed) - 8} more ranks)" if len(failed) > 8 else ""
        return (
            f"upload of {iteration_name(iteration)} to {self.remote.url} failed on {len(failed)} rank(s): "
            f"{where}{more}. It is not committed there; the local copies under {self.local_root} are kept "
            f"(find_latest() finishes the upload when every rank's copy is still there)"
        )

    def _commit_remote(self, iteration: int, holder_dir: Optional[Path] = None) -> None:
        """Write ``metadata.json`` to the remote with a conditional put (the commit). Runs on the
        rank that holds owner 0's local files."""
        directory = holder_dir or self.local_of(iteration)
        data = containment.read_beneath(directory, CONFIG_FNAME, directory, "commit marker")
        self.remote_of(iteration).commit(CONFIG_FNAME, data)

    def _after_commits(self, pending: set) -> Optional[int]:
        """After one or more commits, on the committing rank: one listing of the remote for the
        retention rule and Megatron-LM's tracker file; returns the newest committed iteration
        (None if the listing failed: retention and the tracker are best effort, the commits
        stand)."""
        try:
            state = retention.iterations(self.remote)
            removed = set(retention.trim_remote(self.remote, self.keep_remote, pending, state))
            newest = max((it for it, ok in state.items() if ok and it not in removed), default=None)
            if newest is not None:
                self.remote.put(TRACKER_NAME, str(newest).encode())
            return newest
        except Exception as e:  # noqa: BLE001
            logger.warning("retention or the tracker file on %s failed: %s", self.remote.url, e)
            return None

    # ------------------------------------------------------------------ restart

    def find_latest(self, resume: bool = True) -> Optional[int]:
        """Every rank, the same answer: the newest iteration that is committed on the remote or
        that the local copies of all ranks together can still complete. With ``resume`` (default)
        such a local-only iteration is uploaded (by the ranks holding each owner's files) and
        committed before its number is returned; if that fails, every rank logs why and the
        newest remote checkpoint is the answer. None when neither tier has one."""
        newest_remote = None
        local = markers.scan(self.local_root)
        held = {it: {owner: m.token for owner, m in owners.items()} for it, owners in local.items()}
        worlds = {it: {m.world for m in owners.values()} for it, owners in local.items()}

        def decide(payloads):
            remote = retention.committed(self.remote)
            newest = max(remote, default=None)
            candidates = sorted({it for p in payloads for it in p[0]}, reverse=True)
            for it in candidates:
                if newest is not None and it <= newest:
                    break
                plan = _resume_plan(it, payloads)
                if plan is not None:
                    return newest, it, plan
            return newest, None, None

        newest_remote, candidate, plan = dist.gather_and_decide(
            "tiered find_latest", None, (held, worlds), decide
        )
        if candidate is None or not resume:
            return newest_remote
        try:
            self._resume(candidate, plan)
        except CheckpointingException as e:
            logger.warning(
                "could not finish the upload of %s from the local copies (%s); the newest remote checkpoint "
                "is %s",
                iteration_name(candidate),
                e,
                newest_remote,
            )
            return newest_remote
        return candidate

    def _resume(self, iteration: int, plan: Dict[int, int]) -> None:
        """Every rank: upload the owners' files ``plan`` gives this rank, then the holder of owner
        0's files commits. Raises the same error on every rank on any failure."""
        directory = self.local_of(iteration)
        exc = None
        try:
            names: List[str] = []
            for owner, holder in sorted(plan.items()):
                if holder == self.rank:
                    names += [n for n in markers.read_marker(directory, owner).files if n != CONFIG_FNAME]
            remote = self.remote_of(iteration)
            up = Upload(iteration, directory, remote, names, **self.upload_options)
            up.run()  # in this thread: the resumption is part of find_latest
            if up.error is not None:
                raise up.error
            if plan[0] == self.rank:
                token = markers.read_marker(directory, 0).token
                remote.put(TOKEN_NAME, marker_token_json(token))
        except Exception as e:  # noqa: BLE001 - shared with every rank
            exc = e
        dist.sync_errors("tiered resume upload", exc)
        exc = None
        try:
            if plan[0] == self.rank:
                self._commit_remote(iteration, directory)
                self._after_commits(set())
        except Exception as e:  # noqa: BLE001
            exc = e
        dist.sync_errors("tiered resume commit", exc)
        logger.info("finished the upload of %s from the local copies", iteration_name(iteration))

    # ------------------------------------------------------------------ load

    def load(self, sharded_state_dict, iteration: Optional[int] = None, **load_kwargs):
        """Load ``iteration`` (default: :meth:`find_latest`), each file from the local copy when it
        is this save's and checks out against the remote manifest, else from the remote. Every
        rank. ``self.last_load`` and ``distckpt.last_timings("load")`` say what came from where.
        ``load_kwargs`` go to ``distckpt.load`` (``strict``, ``sharded_strategy`` ...)."""
        from distckpt.loading import load

        iteration = self._to_load(iteration)
        return self._reading(iteration, lambda tier: load(sharded_state_dict, tier, **load_kwargs))

    def load_dcp(self, state_dict, iteration: Optional[int] = None, *, planner=None, **reader_options) -> int:
        """:meth:`load` for PyTorch DCP users: ``dcp.load(state_dict, planner=planner)`` in place
        from ``iteration`` (default: :meth:`find_latest`) through
        :class:`distckpt.dcp.StorageReader` (``reader_options``: ``trusted``, ``verify`` ...),
        each file from the nearest intact copy. Every rank. Returns the iteration loaded."""
        import torch.distributed.checkpoint as dcp

        from distckpt.dcp import StorageReader

        iteration = self._to_load(iteration)
        self._reading(
            iteration,
            lambda tier: dcp.load(
                state_dict, storage_reader=StorageReader(tier, **reader_options), planner=planner
            ),
        )
        return iteration

    def _to_load(self, iteration: Optional[int]) -> int:
        if iteration is None:
            iteration = self.find_latest()
            if iteration is None:
                raise NoCheckpointError(
                    f"no checkpoint to load: none committed at {self.remote.url}, and the local copies "
                    f"under {self.local_root} cannot complete one"
                )
        return iteration

    def _reading(self, iteration: int, read):
        """``read(tier)`` through the read tier of ``iteration``; records what came from where."""
        tier = self.read_tier(iteration)
        try:
            return read(tier)
        finally:
            summary = tier.summary()
            self.last_load = TierLoadReport(
                iteration,
                dict(tier.sources),
                summary["local bytes"],
                summary["remote bytes"],
                summary["rejected"],
            )
            timings.annotate("load", summary)

    def read_tier(self, iteration: int) -> ReadTier:
        """The store a load of ``iteration`` reads through (also used by the CLI)."""
        return read_tier(self.remote_of(iteration), self.local_of(iteration))

    # ------------------------------------------------------------------ end

    def close(self, wait: bool = True) -> None:
        """Every rank: wait for the uploads and commit them (``wait``), or cancel them (each stops
        at its next chunk or file; returns once none writes any more). Nothing is committed then:
        :meth:`find_latest` finishes such an iteration from the local copies later."""
        if wait:
            while self._pending:
                self.finalize(blocking=True)
        else:
            for upload, _ in self._pending.values():
                upload.cancel()
            # Cancelled uploads stop at their next chunk or file; nothing is written after this.
            for upload, _ in self._pending.values():
                upload.wait()
            self._pending.clear()

    @property
    def pending(self) -> List[int]:
        """Iterations whose upload is not finalized yet (this rank)."""
        return sorted(self._pending)


def marker_token_json(token: str) -> bytes:
    return json.dumps({"format": "distckpt-tier", "version": 1, "token": token}).encode()


def remote_token(remote: Store) -> Optional[str]:
    """The save token the remote checkpoint was uploaded with, or None."""
    try:
        raw = bytes(remote.get(TOKEN_NAME))
    except FileNotFoundError:
        return None
    if len(raw) > 4096:
        return None
    try:
        token = json.loads(raw).get("token")
    except (ValueError, AttributeError):
        return None
    return token if isinstance(token, str) else None


def read_tier(remote: Store, local_dir: Optional[Path]) -> ReadTier:
    """A :class:`ReadTier` over the remote checkpoint ``remote`` and its local copy ``local_dir``:
    the local copy is used only when one of its markers carries the remote's save token."""
    manifest = read_manifest(remote)
    local = None
    token = remote_token(remote)
    rejected = None
    if local_dir is not None and local_dir.is_dir() and manifest is not None:
        found, problems = markers.read_all(local_dir)
        for problem in problems:
            logger.warning("ignoring a local tier marker: %s", problem)
        tokens = {m.token for m in found.values()}
        if token is not None and token in tokens:
            local = LocalStore(local_dir)
        elif tokens:
            rejected = (
                f"{local_dir}: a copy of another save (its markers do not carry the remote's save token)"
            )
    tier = ReadTier(local, remote, manifest)
    if rejected:
        tier.rejected["*"] = rejected
    return tier


def _resume_plan(iteration: int, payloads) -> Optional[Dict[int, int]]:
    """owner -> the lowest rank holding its files with one common token, when every owner
    ``0 .. world-1`` of the save is held; else None."""
    tokens, worlds, holders = set(), set(), {}
    for rank, (held, world_sets) in enumerate(payloads):
        owners = held.get(iteration, {})
        for owner, token in owners.items():
            tokens.add(token)
            holders.setdefault(owner, rank)
        worlds |= world_sets.get(iteration, set())
    if len(tokens) != 1 or len(worlds) != 1:
        return None
    (world,) = worlds
    if set(holders) != set(range(world)):
        return None
    return holders
