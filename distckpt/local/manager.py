"""LocalCheckpointManager: frequent node-local checkpoints, replicated to peers, for fast recovery.

Every rank of ``group`` creates one manager over its node-local directory (ranks of one node
share that directory) and calls ``save`` / ``find_latest`` / ``load`` together with the others.

Layout of a node-local directory::

    <root>/iter_0000000100/owner00003.holder00003.dlc   rank 3's piece, kept by rank 3
    <root>/iter_0000000100/owner00001.holder00003.dlc   rank 1's piece, a replica kept by rank 3
    <root>/iter_0000000100/holder00003.json             rank 3's commit marker for iteration 100

A rank only ever creates or removes files with its own ``holderNNNNN`` in the name, so ranks
sharing a node never race on a file.

Save of iteration ``i`` (every rank):

1. stage (training thread): take the state apart, copy tensors to pooled host buffers (async) or
   use them in place (sync); remove this rank's marker of ``i`` if an earlier run left one;
   one tiny all-reduce agrees that staging worked everywhere;
2. write (background thread when async, no process group): the piece goes to
   ``owner<r>.holder<r>.dlc`` via temp file + fsync + rename, its CRC32C computed on the way;
3. replicate: send the piece to the other members of the clique and receive theirs (chunked,
   CRC32C-checked) -- in the background thread over ``replication_group`` when the manager has
   one, else at finalization over ``group``;
4. finalize (training thread, every rank): write the marker ``holder<r>.json`` (atomic) naming
   every file with its size and CRC32C, agree with one all-reduce that every rank committed, and
   only then remove this rank's files of all other iterations.

A crash anywhere before the last agreement leaves the previous iteration whole on every node:
nothing of it is touched before every rank's marker of the new one is durable.

Recovery: ``find_latest`` gathers, in one collective, which copies each rank sees on its node,
and every rank picks the same newest iteration of which every rank's piece has a committed copy
somewhere (one save only: markers carry a save id, so copies of two different saves of the
same iteration number never mix). ``load`` then restores each rank from a copy on its own node,
verifying the CRC32C while it fills the tensors; ranks whose copy is missing or corrupt fetch
one from a peer that holds it (the peer's bytes are checked against the CRC32C that peer recorded,
another copy is tried if they do not match), store it as their own copy, and read it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from distckpt import containment, dist
from distckpt.core import CheckpointingException, PathLike, atomic_write_bytes, fsync_dir
from distckpt.io import staging
from distckpt.io.staging_buffers import StagingBuffers
from distckpt.local.piece import (
    CorruptPieceError,
    SplitState,
    read_piece,
    split_state_dict,
    stage_piece,
    write_piece,
)
from distckpt.local.replication import (
    DEFAULT_CHUNK_BYTES,
    CliqueReplication,
    Incoming,
    Outgoing,
    Received,
    stream_files,
)
from distckpt.mapping import ShardedStateDict, StateDict
from distckpt.strategies.async_utils import AsyncRequest

logger = logging.getLogger(__name__)

MARKER_FORMAT = "distckpt-local"
MARKER_VERSION = 1
_ITER_DIR = re.compile(r"^iter_(\d{10})$")
_MARKER = re.compile(r"^holder(\d{5})\.json$")


class NoLocalCheckpointError(CheckpointingException):
    """No iteration can be restored from the local tier on every rank (raised on every rank
    alike): fall back to the persistent checkpoint."""


def iteration_dir(root: PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:010d}"


def piece_name(owner: int, holder: int) -> str:
    return f"owner{owner:05d}.holder{holder:05d}.dlc"


def marker_name(holder: int) -> str:
    return f"holder{holder:05d}.json"


@dataclass(frozen=True)
class Copy:
    """A committed copy of ``owner``'s piece that group rank ``reporter`` can read on its node."""

    reporter: int
    holder: int
    owner: int
    size: int
    crc: int

    @property
    def name(self) -> str:
        return piece_name(self.owner, self.holder)


@dataclass
class Found:
    """The outcome of :meth:`LocalCheckpointManager.find_latest`, the same on every rank."""

    iteration: int
    save_id: str
    copies: Dict[int, List[Copy]]  # owner -> every committed copy some rank can read


@dataclass
class LoadReport:
    """Where this rank's piece came from in the last ``load``: ``"local"`` or ``"rank N"``, and
    the copies that were found corrupt or missing on the way."""

    iteration: int
    source: str
    rejected: List[str] = field(default_factory=list)
    seconds: float = 0.0


class LocalCheckpointManager:
    """Node-local checkpoints of every rank, replicated to ``replication_factor - 1`` peers.

    Args:
        root_dir: this rank's node-local directory (shared by the ranks of one node).
        group: the process group of the ranks taking part (default: the whole world); gloo or
            NCCL. Every rank of it constructs a manager and calls each method together.
        replication_factor: copies of every piece, own included (1: no replication).
        node_size: ranks per node (rank ``r`` lives on node ``r // node_size``); default
            ``$LOCAL_WORLD_SIZE`` or 1.
        replication_jump: distance between clique members (default ``node_size``): see
            :class:`~distckpt.local.replication.CliqueReplication`.
        chunk_bytes: largest piece of a file sent or received at once (memory per transfer).
        trusted: unpickle common state and objects without the allowlist.
        replication_group: a process group of the same ranks reserved for the local tier
            (e.g. ``torch.distributed.new_group(backend="gloo")``). With it, an async save
            replicates in the background thread too, over this group, and only the commit
            runs at finalization. Without it replication runs at finalization over ``group``
            (a background thread must not share a process group with the training thread).

    Construction runs one broadcast (a run id that tells saves of different runs apart).
    """

    def __init__(
        self,
        root_dir: PathLike,
        group: dist.ProcessGroup = None,
        replication_factor: int = 2,
        node_size: Optional[int] = None,
        replication_jump: Optional[int] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        trusted: bool = False,
        replication_group: dist.ProcessGroup = None,
    ):
        self.root = Path(root_dir)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.node_size = int(node_size or os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.replication = CliqueReplication(int(replication_factor), int(replication_jump or self.node_size))
        self.chunk_bytes = int(chunk_bytes)
        self.trusted = trusted
        self.replication_group = replication_group
        if replication_group is not None and dist.get_world_size(replication_group) != self.world:
            raise CheckpointingException("replication_group must hold the same ranks as group")
        if self.chunk_bytes < 1:
            raise CheckpointingException(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.replication.check(self.world, self.node_size)
        self.run_id = dist.broadcast_object(uuid.uuid4().hex if self.rank == 0 else None, 0, group)
        self._found: Optional[Found] = None
        self.last_saved: Optional[int] = None
        self.last_load: Optional[LoadReport] = None
        self._in_flight: set = set()  # iterations staged by this manager, not committed yet

    # ------------------------------------------------------------------ save

    def save(
        self, sharded_state_dict: ShardedStateDict, iteration: int, is_async: bool = False
    ) -> Optional[AsyncRequest]:
        """Save this rank's state as ``iteration``; every rank calls it.

        Synchronous: returns once the iteration is committed on every rank (and the previous
        one removed). ``is_async``: returns an ``AsyncRequest`` once the tensors are staged;
        schedule it on an ``AsyncCallsQueue`` (the piece is written in the background; the
        replication and the commit run when the queue finalizes it) or call ``execute_sync()``.
        Several async saves may be in flight; the queue finalizes them in order. Iterations
        must increase from one save to the next.

        Raises:
            CheckpointingException (the same on every rank): staging, writing, replication or
                the commit failed somewhere; the previous iteration is still there.
        """
        exc: Optional[BaseException] = None
        piece = None
        save_id = f"{self.run_id}:{iteration}"
        directory = iteration_dir(self.root, iteration) if isinstance(iteration, int) else self.root
        try:
            if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
                raise CheckpointingException(f"iteration must be a non-negative int, got {iteration!r}")
            before = max(
                [*self._in_flight, *([] if self.last_saved is None else [self.last_saved])], default=None
            )
            if before is not None and iteration <= before:
                raise CheckpointingException(
                    f"iteration {iteration} is not after the last one saved or being saved ({before})"
                )
            # An async save copies into the process-wide staging pool (shared with the global saves).
            piece = stage_piece(sharded_state_dict, StagingBuffers(staging.pool()) if is_async else None)
            directory.mkdir(parents=True, exist_ok=True)
            self._remove(directory / marker_name(self.rank))
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e
        self._agree("local save (staging)", exc)
        self._in_flight.add(iteration)

        own = directory / piece_name(self.rank, self.rank)
        background = is_async and self.replication_group is not None
        written: Dict[str, Any] = {}

        def write() -> None:
            try:
                written["own"] = write_piece(piece, own)
            except BaseException:
                if background:  # still take part, announcing nothing: no peer waits forever
                    self._replicate(directory, own, None, self.replication_group)
                raise
            if background:
                written["replicas"] = self._replicate(directory, own, written["own"], self.replication_group)

        def finalize() -> None:
            try:
                replicas = written.get("replicas")
                if replicas is None:
                    replicas = self._replicate(directory, own, written["own"], self.group)
                self._commit(iteration, save_id, directory, own, written["own"], replicas)
            finally:
                self._in_flight.discard(iteration)

        if is_async:
            # A queue runs none of distckpt's finalize fns after a failed write (on any rank):
            # the iteration is then no longer being saved, and may be saved again.
            return AsyncRequest(write, (), [finalize], [lambda: self._in_flight.discard(iteration)])
        exc = None
        try:
            write()
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e
        try:
            self._agree("local save (write)", exc)
        except CheckpointingException:
            self._in_flight.discard(iteration)
            raise
        finalize()
        return None

    def _replicate(
        self, directory: Path, own: Path, own_meta: Optional[Tuple[int, int]], group: dist.ProcessGroup
    ) -> List[Received]:
        """Send the own piece to the clique (nothing, announced as such, if ``own_meta`` is None)
        and receive the other members' pieces. Every rank of ``group`` calls it."""
        rounds = self.replication.peers(self.rank)
        size, crc = own_meta if own_meta is not None else (-1, 0)
        sends = [Outgoing(to, own if own_meta is not None else None, size, crc) for to, _ in rounds]
        recvs = [Incoming(frm, directory / piece_name(frm, self.rank)) for _, frm in rounds]
        return stream_files(sends, recvs, group, self.chunk_bytes)

    def _commit(
        self,
        iteration: int,
        save_id: str,
        directory: Path,
        own: Path,
        own_meta: Tuple[int, int],
        received: List[Received],
    ) -> None:
        """Write this rank's marker once every replica arrived; agree; remove other iterations."""
        exc: Optional[BaseException] = None
        try:
            failed = [r.error for r in received if not r.ok]
            if failed:
                raise CheckpointingException(
                    f"replication of iteration {iteration} to rank {self.rank} failed: " + "; ".join(failed)
                )
            files = {own.name: {"owner": self.rank, "size": own_meta[0], "crc32c": own_meta[1]}}
            for r in received:
                files[r.path.name] = {"owner": r.peer, "size": r.size, "crc32c": r.crc}
            self._write_marker(directory, iteration, save_id, files)
        except Exception as e:  # noqa: BLE001
            exc = e
        self._agree("local save (commit)", exc)
        self.last_saved = iteration if self.last_saved is None else max(self.last_saved, iteration)
        # The queue finalizes in order: an earlier save still "in flight" now is one whose write
        # failed (the queue dropped it), so its files are left-overs like any other.
        self._in_flight = {i for i in self._in_flight if i > iteration}
        self._remove_other_iterations(iteration)

    def _write_marker(self, directory: Path, iteration: int, save_id: str, files: Dict[str, dict]) -> None:
        atomic_write_bytes(
            directory / marker_name(self.rank),
            json.dumps(
                {
                    "format": MARKER_FORMAT,
                    "version": MARKER_VERSION,
                    "save_id": save_id,
                    "iteration": iteration,
                    "world": self.world,
                    "holder": self.rank,
                    "files": files,
                },
                sort_keys=True,
            ).encode(),
        )

    def _remove_other_iterations(self, keep: int) -> None:
        """Remove this rank's files of every iteration but ``keep`` and those still being saved
        (older ones, and newer ones left by an earlier run that restarted from further back)."""
        mine = f"holder{self.rank:05d}"
        for directory in self._iteration_dirs():
            if directory[0] == keep or directory[0] in self._in_flight:
                continue
            path = directory[1]
            # The marker goes first: a half-removed iteration never looks complete.
            if self._remove(path / marker_name(self.rank)):
                fsync_dir(path)
            for entry in list(os.scandir(path)):
                if mine in entry.name:
                    self._remove(Path(entry.path))
            try:
                path.rmdir()
            except OSError:
                pass  # other ranks of this node still have files there

    # ------------------------------------------------------------------ recovery

    def find_latest(self) -> Optional[int]:
        """The newest iteration that every rank can restore, or None; every rank calls it.

        One all-gather of what each rank sees on its node. The answer is the same on every rank.
        """
        self._found = self._discover(None)
        return None if self._found is None else self._found.iteration

    def _discover(self, iteration: Optional[int]) -> Optional[Found]:
        exc: Optional[BaseException] = None
        seen: List[Tuple[int, str, Copy]] = []
        try:
            seen = self._scan(iteration)
        except Exception as e:  # noqa: BLE001
            exc = e
        reports = dist.all_gather_or_raise("local checkpoint discovery", exc, seen, self.group)
        saves: Dict[Tuple[int, str], Dict[int, List[Copy]]] = {}
        for report in reports:
            for it, save_id, c in report:
                copies = saves.setdefault((it, save_id), {}).setdefault(c.owner, [])
                if c not in copies:
                    copies.append(c)
        complete = [key for key, owners in saves.items() if len(owners) == self.world]
        if not complete:
            return None
        it, save_id = max(complete)
        return Found(it, save_id, saves[(it, save_id)])

    def _scan(self, only: Optional[int]) -> List[Tuple[int, str, Copy]]:
        """The committed copies on this node whose files are present with the recorded size."""
        out = []
        for it, path in self._iteration_dirs():
            if only is not None and it != only:
                continue
            for entry in os.scandir(path):
                if not _MARKER.match(entry.name):
                    continue
                try:
                    marker = json.loads(containment.read_beneath(path, entry.name, path, "commit marker"))
                    if marker.get("format") != MARKER_FORMAT or int(marker["version"]) > MARKER_VERSION:
                        raise ValueError("not a local checkpoint marker")
                    if int(marker["world"]) != self.world or int(marker["iteration"]) != it:
                        logger.info(
                            "%s: saved by %s ranks at iteration %s; skipped",
                            entry.path,
                            marker["world"],
                            marker["iteration"],
                        )
                        continue
                    holder, save_id = int(marker["holder"]), str(marker["save_id"])
                    for name, f in marker["files"].items():
                        c = Copy(self.rank, holder, int(f["owner"]), int(f["size"]), int(f["crc32c"]))
                        if name != c.name or not 0 <= c.owner < self.world:
                            raise ValueError(f"bad entry {name!r}")
                        try:
                            if containment.size_beneath(path, name, entry.path, "local piece") != c.size:
                                logger.warning("%s: size differs from its marker; not used", path / name)
                                continue
                        except FileNotFoundError:
                            continue
                        out.append((it, save_id, c))
                except (
                    OSError,
                    ValueError,
                    KeyError,
                    TypeError,
                    AttributeError,
                    CheckpointingException,
                ) as e:
                    logger.warning("%s: unreadable commit marker (%s); ignored", entry.path, e)
        return out

    def load(self, sharded_state_dict: ShardedStateDict, iteration: Optional[int] = None) -> StateDict:
        """Restore every rank's state of ``iteration`` (default: :meth:`find_latest`'s); every
        rank calls it with the same structure it saved.

        Returns the state dict as ``distckpt.load`` does (tensors given are filled in place).
        :attr:`last_load` tells where the piece came from.

        Raises:
            NoLocalCheckpointError (every rank alike): no restorable iteration (or not the
                requested one): load the persistent checkpoint instead.
            CheckpointingException (every rank alike): the request does not match the saved
                state, or no intact copy of some rank's piece is left.
        """
        start = time.perf_counter()
        found = (
            self._found if self._found is not None and iteration in (None, self._found.iteration) else None
        )
        if found is None:
            found = self._discover(iteration)
        self._found = None
        if found is None or (iteration is not None and found.iteration != iteration):
            what = "no iteration" if iteration is None else f"iteration {iteration} cannot be"
            raise NoLocalCheckpointError(
                f"{what} restored from the local checkpoints of all {self.world} ranks (root of rank "
                f"{self.rank}: {self.root}); fall back to the persistent checkpoint"
            )
        directory = iteration_dir(self.root, found.iteration)
        report = LoadReport(found.iteration, "local")
        state: Any = None
        exc: Optional[BaseException] = None
        split: Optional[SplitState] = None
        try:
            split = split_state_dict(sharded_state_dict)
            mine = sorted(
                (c for c in found.copies[self.rank] if c.reporter == self.rank),
                key=lambda c: c.holder != self.rank,
            )
            for c in mine:
                try:
                    state = read_piece(directory / c.name, split, c.size, c.crc, self.trusted)
                    break
                except CorruptPieceError as e:
                    logger.warning("%s", e)
                    report.rejected.append(str(e))
        except Exception as e:  # noqa: BLE001
            exc = e
        tried: Dict[int, set] = {}
        while True:
            needy = dist.all_gather_or_raise("local load", exc, state is None, self.group)
            needy = [r for r, need in enumerate(needy) if need]
            if not needy:
                break
            plan = self._plan(found, needy, tried)
            sends = [
                Outgoing(owner, directory / c.name, c.size, c.crc)
                for owner, c in sorted(plan.items())
                if c.reporter == self.rank
            ]
            recvs = []
            if self.rank in plan:
                report.source = f"rank {plan[self.rank].reporter}"
                recvs = [Incoming(plan[self.rank].reporter, directory / piece_name(self.rank, self.rank))]
            received = stream_files(sends, recvs, self.group, self.chunk_bytes)
            exc = None
            try:
                if received:
                    got = received[0]
                    if not got.ok:
                        report.rejected.append(got.error)
                    else:
                        self._adopt(found, directory, got.size, got.crc)
                        state = read_piece(got.path, split, got.size, got.crc, self.trusted)
            except CorruptPieceError as e:
                report.rejected.append(str(e))
            except Exception as e:  # noqa: BLE001
                exc = e
        report.seconds = time.perf_counter() - start
        self.last_load = report
        return state

    def _plan(self, found: Found, needy: List[int], tried: Dict[int, set]) -> Dict[int, Copy]:
        """For each needy rank, a copy of its piece on another rank not tried yet (the same
        choice on every rank). Raises the same error everywhere if some rank has none left."""
        plan: Dict[int, Copy] = {}
        lost = []
        for owner in needy:
            # The owner itself already read every copy on its node.
            done = tried.setdefault(owner, {c.holder for c in found.copies[owner] if c.reporter == owner})
            candidates = [c for c in found.copies[owner] if c.holder not in done]
            if not candidates:
                lost.append(owner)
                continue
            holders = sorted({c.holder for c in candidates})
            # Spread the work: each needy rank starts at another holder, and takes the copy from
            # one of the ranks that can read it (they share the holder's node).
            holder = holders[owner % len(holders)]
            readers = sorted((c for c in candidates if c.holder == holder), key=lambda c: c.reporter)
            plan[owner] = readers[owner % len(readers)]
            done.add(holder)
        if lost:
            raise NoLocalCheckpointError(
                f"iteration {found.iteration}: no intact copy of the piece of rank(s) {lost} is left "
                f"(every copy was missing or failed its CRC32C); fall back to the persistent checkpoint"
            )
        return plan

    def _adopt(self, found: Found, directory: Path, size: int, crc: int) -> None:
        """Record a fetched piece as this rank's own copy in its marker for the iteration."""
        path = directory / marker_name(self.rank)
        files: Dict[str, dict] = {}
        try:
            marker = json.loads(path.read_bytes())
            if marker.get("save_id") == found.save_id:
                files = dict(marker["files"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        files[piece_name(self.rank, self.rank)] = {"owner": self.rank, "size": size, "crc32c": crc}
        self._write_marker(directory, found.iteration, found.save_id, files)

    # ------------------------------------------------------------------ helpers

    def _agree(self, stage: str, exc: Optional[BaseException]) -> None:
        """Raise the same error on every rank if ``exc`` is set on any; one tiny all-reduce."""
        (failed,) = dist.all_reduce_max([int(exc is not None)], self.group)
        if failed:
            dist.sync_errors(stage, exc, self.group)

    def _iteration_dirs(self) -> List[Tuple[int, Path]]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            m = _ITER_DIR.match(entry.name)
            if m and entry.is_dir():
                found.append((int(m.group(1)), Path(entry.path)))
        return sorted(found)

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            os.remove(path)
            return True
        except FileNotFoundError:
            return False
