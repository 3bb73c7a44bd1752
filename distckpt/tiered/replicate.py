"""Copies of each rank's local files on peers in other nodes (``replication_factor`` > 1).

The cliques are the local tier's (:class:`distckpt.local.replication.CliqueReplication`): with
factor F and jump J (ranks per node by default), ranks ``n, n + J, ..., n + (F - 1) J`` hold
each other's files, so F - 1 lost nodes still leave one copy of every rank's part of a tiered
save, and :meth:`TieredCheckpointManager.find_latest` can finish its upload from the survivors.

Every rank calls :func:`replicate` at once. The ranks first share their file lists (one
all-gather), then stream the files to their clique peers one file per round
(:func:`distckpt.local.replication.stream_files`: bounded chunks, CRC32C checked on arrival). A
peer's marker is written beside its files only once every one of them arrived intact; a failure
anywhere raises the same error on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from distckpt import bounds, containment, dist
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import crc32c
from distckpt.local.replication import (
    DEFAULT_CHUNK_BYTES,
    CliqueReplication,
    Incoming,
    Outgoing,
    stream_files,
)
from distckpt.tiered.markers import Marker, write_marker


def cliques(
    factor: int, node_size: Optional[int], jump: Optional[int], world: int
) -> Optional[CliqueReplication]:
    """The clique layout for ``factor`` copies (None for 1: no replication), checked."""
    factor = int(factor)
    if factor == 1:
        return None
    node = int(node_size or os.environ.get("LOCAL_WORLD_SIZE", 1))
    layout = CliqueReplication(factor, int(jump or node))
    layout.check(world, node)
    return layout


def file_crc(directory: Path, name: str) -> int:
    fd = containment.open_beneath(directory, name, directory, "file to replicate")
    try:
        crc, offset = 0, 0
        while True:
            data = os.pread(fd, DEFAULT_CHUNK_BYTES, offset)
            if not data:
                return crc
            crc = crc32c(data, crc)
            offset += len(data)
    finally:
        os.close(fd)


def replicate(
    directory: Path, marker: Marker, layout: CliqueReplication, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> None:
    """Send this rank's files (``marker.files``) to its clique peers and receive theirs."""
    rank = dist.get_rank()
    lists: List[Dict] = dist.all_gather_object(
        {"token": marker.token, "files": marker.files}, stage="tiered replication (lists)"
    )
    rounds = layout.peers(rank)
    mine = sorted(marker.files)
    longest = max(len(entry["files"]) for entry in lists)
    failures: List[str] = []
    for k in range(longest):
        sends, recvs = [], []
        if k < len(mine):
            name = mine[k]
            size, crc = marker.files[name], file_crc(directory, name)
            sends = [Outgoing(to, directory / name, size, crc) for to, _ in rounds]
        for _, frm in rounds:
            theirs = sorted(lists[frm]["files"])
            if k < len(theirs):
                target = bounds.inside(directory, theirs[k], f"rank {frm}'s file list", "replicated file")
                recvs.append(Incoming(frm, target))
        for got in stream_files(sends, recvs, None, chunk_bytes):
            if not got.ok:
                failures.append(got.error or f"{got.path} from rank {got.peer} did not arrive")
    exc = None
    if failures:
        exc = CheckpointingException(f"replication to rank {rank} failed: " + "; ".join(failures[:4]))
    else:
        try:
            for _, frm in rounds:
                write_marker(
                    directory,
                    Marker(lists[frm]["token"], marker.iteration, marker.world, frm, lists[frm]["files"]),
                )
        except OSError as e:
            exc = e
    dist.sync_errors("tiered replication", exc)
