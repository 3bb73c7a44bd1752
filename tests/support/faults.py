"""Fault doubles for tests: strategies and storage that fail at a named stage on chosen ranks.

Like PyTorch DCP's ``FaultyStorageWriter``, a :class:`Fault` names *where* a save or load breaks
and *on which ranks*. Every rank calls :func:`save_with_fault` / :func:`load_with_fault` with the
same fault; only the chosen ranks misbehave, the others run the real code. Faults are injected by
subclassing the real strategies (``prepare``, ``finalize``, ``save_common``) or by patching one
module attribute for the duration of the call; the patches are undone in ``finally`` because the
rank-pool processes are reused by other tests.

Save stages, in the order a save reaches them (see docs/reliability.md):

=================  ==========================================================================
``validation``     local sharding validation raises (before any byte is written)
``common``         the common strategy's ``save_common`` raises
``prepare``        the torch_dist strategy's planning (``prepare``) raises
``write``          every data file is written, then ``write_plan`` raises
``mid_file``       the storage fails with ENOSPC in the middle of a ``.distcp`` file
``finalize``       the rank reports a failure to the finalize collective
``metadata_write`` rank 0 fails to write ``.metadata`` (torch_dist finalize)
``manifest_write`` rank 0 wrote ``.metadata`` and fails to write the manifest
``commit``         the sharded strategy finished writing, then the rank fails before the commit
``commit_write``   rank 0 fails to write ``metadata.json`` (the commit marker)
``async_write``    the background write of an async save raises
=================  ==========================================================================

Load stage: ``read`` (an I/O error while reading a stored chunk).

The module also holds the state used by the fault tests (a *generation* of a small TP/DP model,
so that a mix of two saves is detectable), byte-level corruption helpers, and the entry point of
the rank processes of the SIGKILL test (``python -m tests.support.faults sigkill-rank ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import distckpt
from distckpt import ShardedObject, commit, loading, saving
from distckpt import dist as ddist
from distckpt.formats.manifest import RangeChecksum, crc32c, read_manifest, write_manifest
from distckpt.formats.zip_archive import read_archive_layout
from distckpt.io.filesystem import ChecksummingSink
from distckpt.strategies.base import SaveShardedStrategy
from distckpt.strategies.common import TorchCommonSaveStrategy
from distckpt.strategies.torch import TorchDistSaveShardedStrategy
from distckpt.strategies.torch_dist import read as torch_dist_read
from distckpt.strategies.torch_dist import save as torch_dist_save
from distckpt.strategies.torch_dist import spans as torch_dist_spans
from distckpt.strategies.torch_dist import write as torch_dist_write
from distckpt.strategies.torch_dist.spans import PositionedSink
from tests.support import layouts

SAVE_STAGES = (
    "validation",
    "common",
    "prepare",
    "write",
    "mid_file",
    "finalize",
    "metadata_write",
    "manifest_write",
    "commit",
    "commit_write",
    "async_write",
)
RANK0_ONLY_STAGES = ("metadata_write", "manifest_write", "commit_write")


class InjectedFault(RuntimeError):
    """The error a fault double raises; its message names the stage and the rank."""


def _message(stage: str) -> str:
    return f"injected {stage} fault on rank {ddist.get_rank()}"


def _os_error(code: int, stage: str) -> OSError:
    return OSError(code, f"{os.strerror(code)} ({_message(stage)})")


@dataclass(frozen=True)
class Fault:
    """Where a save or load fails (``stage``) and on which ranks."""

    stage: str
    ranks: Tuple[int, ...]

    def __post_init__(self) -> None:
        if self.stage not in SAVE_STAGES + ("read",):
            raise ValueError(f"unknown fault stage {self.stage!r}")

    @property
    def here(self) -> bool:
        return ddist.get_rank() in self.ranks


# --------------------------------------------------------------------------- strategy doubles


class FaultyTorchDistSave(TorchDistSaveShardedStrategy):
    """The real ``torch_dist`` save strategy, failing in ``prepare`` or ``finalize`` on ``ranks``.

    ``finalize`` failures are *reported* to the finalize collective (as the real strategy does
    with its own write errors), so the other ranks learn of them there.
    """

    def __init__(self, stage: str, ranks: Sequence[int]):
        super().__init__()
        self.stage, self.ranks = stage, tuple(ranks)

    def _fails(self, stage: str) -> bool:
        return self.stage == stage and ddist.get_rank() in self.ranks

    def prepare(self, sharded_state_dict, checkpoint_dir, stage: bool = False):
        if self._fails("prepare"):
            raise InjectedFault(_message("prepare"))
        return super().prepare(sharded_state_dict, checkpoint_dir, stage)

    def finalize(self, plan, checkpoint_dir, exc):
        if exc is None and self._fails("finalize"):
            exc = InjectedFault(_message("finalize"))
        super().finalize(plan, checkpoint_dir, exc)


class FaultyCommonSave(TorchCommonSaveStrategy):
    """The real common strategy whose ``save_common`` fails on ``ranks`` (rank 0 after it began
    writing ``common.pt``, so a partial file is left behind)."""

    def __init__(self, ranks: Sequence[int]):
        super().__init__()
        self.ranks = tuple(ranks)

    def save_common(self, common_state_dict, checkpoint_dir) -> None:
        if ddist.get_rank() not in self.ranks:
            super().save_common(common_state_dict, checkpoint_dir)
            return
        if ddist.get_rank() == 0:
            with open(Path(checkpoint_dir) / "common.pt", "wb") as f:
                f.write(b"PK\x03\x04 partial")
        raise _os_error(errno.EIO, "common")


class FailBeforeCommit(SaveShardedStrategy):
    """Saves with the real ``torch_dist`` strategy (``.metadata`` and manifest included), then
    fails on ``ranks``: every byte is on disk, only the commit is missing."""

    def __init__(self, ranks: Sequence[int]):
        self.inner = TorchDistSaveShardedStrategy()
        super().__init__(self.inner.backend, self.inner.version)
        self.ranks = tuple(ranks)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.inner.can_handle_sharded_objects

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        self.inner.save(sharded_state_dict, checkpoint_dir)
        if ddist.get_rank() in self.ranks:
            raise InjectedFault(_message("commit"))


class FaultySink(ChecksummingSink):
    """A ``.distcp`` writer whose storage runs out of space after its first item (mid-file: a
    small tensor item is one write, a large one several)."""

    writes_before_failure = 1

    def __init__(self, fd: int, *args):
        super().__init__(fd, *args)
        self.writes = 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes > self.writes_before_failure:
            raise _os_error(errno.ENOSPC, "mid_file")
        return super().write(data)


class FaultyPositionedSink(FaultySink, PositionedSink):
    """:class:`FaultySink` for the threads that share a file (each part's writer fails after
    its first write)."""


def sinks_patched(stack: contextlib.ExitStack, one_thread: type, shared: type) -> None:
    """Write ``.distcp`` files through ``one_thread`` (a file written by one thread) and
    ``shared`` (the parts of a file that several threads write) for the stack's duration."""
    stack.enter_context(patched(torch_dist_write, "ChecksummingSink", one_thread))
    stack.enter_context(patched(torch_dist_spans, "PositionedSink", shared))


# --------------------------------------------------------------------------- patching


@contextlib.contextmanager
def patched(module: Any, name: str, replacement: Any) -> Iterator[None]:
    """Replace ``module.name`` for the duration; always restored."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _failing_after(fn, stage: str, code: Optional[int] = None):
    def wrapper(*args, **kwargs):
        fn(*args, **kwargs)
        raise _os_error(code, stage) if code is not None else InjectedFault(_message(stage))

    return wrapper


def _failing(stage: str, code: int):
    def wrapper(*args, **kwargs):
        raise _os_error(code, stage)

    return wrapper


@contextlib.contextmanager
def injected(fault: Fault) -> Iterator[None]:
    """Install the module patches ``fault`` needs on this rank (none elsewhere)."""
    with contextlib.ExitStack() as stack:
        if fault.here:
            stage = fault.stage
            if stage == "validation":

                def validate(shards, _real=saving.validate_local_integrity):
                    _real(shards)
                    raise InjectedFault(_message("validation"))

                stack.enter_context(patched(saving, "validate_local_integrity", validate))
                stack.enter_context(patched(loading, "validate_local_integrity", validate))
            elif stage in ("write", "async_write"):
                stack.enter_context(
                    patched(torch_dist_save, "write_plan", _failing_after(torch_dist_save.write_plan, stage))
                )
            elif stage == "mid_file":
                sinks_patched(stack, FaultySink, FaultyPositionedSink)
            elif stage == "metadata_write":
                stack.enter_context(
                    patched(torch_dist_save, "atomic_write_bytes", _failing(stage, errno.EIO))
                )
            elif stage == "manifest_write":
                stack.enter_context(patched(torch_dist_save, "write_manifest", _failing(stage, errno.ENOSPC)))
            elif stage == "commit_write":
                stack.enter_context(patched(commit, "save_config", _failing(stage, errno.EIO)))
            elif stage == "read":
                stack.enter_context(patched(torch_dist_read, "read_chunk", _failing(stage, errno.EIO)))
        yield


def save_strategies(fault: Optional[Fault]) -> Tuple[SaveShardedStrategy, TorchCommonSaveStrategy]:
    """The (sharded, common) strategies a save with ``fault`` uses; real ones for patch faults."""
    if fault is not None and fault.stage in ("prepare", "finalize"):
        return FaultyTorchDistSave(fault.stage, fault.ranks), TorchCommonSaveStrategy()
    if fault is not None and fault.stage == "common":
        return TorchDistSaveShardedStrategy(), FaultyCommonSave(fault.ranks)
    if fault is not None and fault.stage == "commit":
        return FailBeforeCommit(fault.ranks), TorchCommonSaveStrategy()
    return TorchDistSaveShardedStrategy(), TorchCommonSaveStrategy()


# --------------------------------------------------------------------------- the saved state


def _tp(world: int) -> int:
    return min(world, 2)


def _generation_piece(piece: layouts.Piece, generation: int) -> layouts.Piece:
    return dataclasses.replace(piece, key=f"{piece.key}@{generation}")


def generation_state(rank: int, world: int, generation: int, with_data: bool = True) -> dict:
    """A small TP/DP model whose every value depends on ``generation`` (keys do not), plus a
    ShardedObject and common state: loading a mix of two generations cannot go unnoticed."""
    sd = {}
    for piece in layouts.tp_dp(rank, world, tp=_tp(world)):
        sh = piece.sharded(with_data=False)
        if with_data:
            sh.data = _generation_piece(piece, generation).expected()
        sd[piece.name] = sh
    payload = {"generation": generation, "state": torch.arange(4) + generation} if with_data else None
    sd["rng"] = ShardedObject("rng", payload, (1,), (0,), replica_id=rank)
    sd["common"] = {"generation": generation}
    return sd


def generation_mismatches(loaded: dict, rank: int, world: int, generation: int) -> List[str]:
    """Names of the entries of ``loaded`` that are not exactly ``generation``'s values."""
    wrong = []
    for piece in layouts.tp_dp(rank, world, tp=_tp(world)):
        if not layouts.bitwise_equal(loaded[piece.name], _generation_piece(piece, generation).expected()):
            wrong.append(piece.name)
    rng = loaded.get("rng")
    if not (
        isinstance(rng, dict)
        and rng.get("generation") == generation
        and torch.equal(rng["state"], torch.arange(4) + generation)
    ):
        wrong.append("rng")
    if loaded.get("common") != {"generation": generation}:
        wrong.append("common")
    return wrong


# --------------------------------------------------------------------------- rank functions


def save_with_fault(ckpt: str, generation: int, fault: Optional[Fault]) -> None:
    """Every rank: save ``generation`` into ``ckpt`` with ``fault`` injected (None: healthy)."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd = generation_state(rank, world, generation)
    sharded, common = save_strategies(fault)
    with injected(fault) if fault is not None else contextlib.nullcontext():
        if fault is not None and fault.stage == "async_write":
            distckpt.save(sd, ckpt, sharded, common, async_sharded_save=True).execute_sync()
        else:
            distckpt.save(sd, ckpt, sharded, common)


def load_with_fault(
    ckpt: str, generation: int, fault: Optional[Fault] = None, verify: bool = False
) -> List[str]:
    """Every rank: load ``ckpt`` and return what differs from ``generation`` (empty = exact)."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    with injected(fault) if fault is not None else contextlib.nullcontext():
        loaded = distckpt.load(
            generation_state(rank, world, generation, with_data=False), ckpt, verify=verify
        )
    return generation_mismatches(loaded, rank, world, generation)


# --------------------------------------------------------------------------- corruption helpers


def flip_byte(path: Path, offset: int, mask: int = 0x10) -> None:
    """XOR one byte of ``path`` with ``mask`` (applying it twice restores the file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        if len(byte) != 1:
            raise ValueError(f"{path} has no byte at offset {offset}")
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def item_range(ckpt: Path, key: str) -> Tuple[str, RangeChecksum]:
    """The manifest's (file, range) of the item stored under ``key``."""
    manifest = read_manifest(ckpt)
    for name, ranges in manifest.ranges.items():
        for r in ranges:
            if r.key == key:
                return name, r
    raise KeyError(f"no item {key!r} in the manifest of {ckpt}")


def tensor_bytes_middle(ckpt: Path, key: str) -> Tuple[str, int]:
    """(file, offset) of the middle byte of the tensor data of item ``key`` (not its zip headers)."""
    name, r = item_range(ckpt, key)
    raw = (ckpt / name).read_bytes()[r.offset : r.offset + r.length]
    layout = read_archive_layout(lambda o, n: raw[o : o + n], len(raw))
    if layout is None:
        raise ValueError(f"item {key!r} is not a plain tensor archive")
    return name, r.offset + layout.data_offset + layout.data_length // 2


def reseal_manifest(ckpt: Path, extra: Sequence[Tuple[str, RangeChecksum]] = ()) -> None:
    """Rewrite the manifest so that it matches the files as they are now (what an attacker who
    crafts a whole checkpoint can do): sizes, whole-file ranges and every range's CRC32C."""
    manifest = read_manifest(ckpt)
    for name, r in extra:
        manifest.ranges.setdefault(name, []).append(r)
    for name in list(manifest.files):
        data = (ckpt / name).read_bytes()
        whole = manifest.ranges.get(name, [])
        if len(whole) == 1 and whole[0].offset == 0 and whole[0].length == manifest.files[name]:
            whole = [RangeChecksum(0, len(data), 0, whole[0].key)]
        manifest.files[name] = len(data)
        manifest.ranges[name] = [
            RangeChecksum(r.offset, r.length, crc32c(data[r.offset : r.offset + r.length]), r.key)
            for r in whole
        ]
    write_manifest(ckpt, manifest)


def tree_digest(root: Path) -> Dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- SIGKILL rank process


class StallingSink(ChecksummingSink):
    """Writes the first item of a ``.distcp`` file, then announces it and stalls at the second
    (to be killed)."""

    marker: Optional[Path] = None

    def __init__(self, fd: int, *args):
        super().__init__(fd, *args)
        self.writes = 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == 2:
            os.fsync(self.fd)
            self.marker.write_text(str(self.position))
            time.sleep(600)
        return super().write(data)


class StallingPositionedSink(StallingSink, PositionedSink):
    """:class:`StallingSink` for the threads that share a file."""


def _stalling_save_config(marker: Path):
    def stall(config, checkpoint_dir):
        marker.write_text("before metadata.json")
        time.sleep(600)

    return stall


def _sigkill_rank(args: argparse.Namespace) -> int:
    """One rank of the SIGKILL test: save generation 1 into ``neighbour`` and ``target``, record
    the neighbour's bytes, then save generation 2 into ``target`` while the victim stalls at
    ``--window`` until the test kills it."""
    root = Path(args.root)
    torch.set_num_threads(1)
    # A FileStore rendezvous: no port to pick, so no race for one; gloo itself runs on loopback.
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{root / 'rendezvous'}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    save_with_fault(str(root / "neighbour"), 1, None)
    save_with_fault(str(root / "target"), 1, None)
    ddist.barrier()
    if args.rank == 0:
        (root / "phase1.json").write_text(
            json.dumps(
                {
                    "neighbour": tree_digest(root / "neighbour"),
                    "target": tree_digest(root / "target"),
                    "target_sizes": {p.name: p.stat().st_size for p in (root / "target").iterdir()},
                }
            )
        )
    ddist.barrier()
    stalled = root / f"stalled.{args.rank}"
    with contextlib.ExitStack() as stack:
        if args.rank == args.victim:
            if args.window == "mid_write":
                StallingSink.marker = stalled
                sinks_patched(stack, StallingSink, StallingPositionedSink)
            else:
                stack.enter_context(patched(commit, "save_config", _stalling_save_config(stalled)))
        try:
            save_with_fault(str(root / "target"), 2, None)
        except BaseException as e:  # noqa: BLE001 - the survivor reports and exits non-zero
            (root / f"failed.{args.rank}").write_text(f"{type(e).__name__}: {e}")
            return 3
    (root / f"returned.{args.rank}").write_text("save returned")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.faults")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sigkill-rank", help="one rank process of the SIGKILL test")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--root", required=True)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--window", choices=("mid_write", "before_commit"), required=True)
    p.add_argument("--pg-timeout", type=float, default=20)
    args = parser.parse_args(argv)
    return _sigkill_rank(args)


if __name__ == "__main__":
    sys.exit(main())
