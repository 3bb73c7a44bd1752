"""Where each rank's piece is replicated (cliques across nodes), and streaming files to peers.

Cliques: with replication factor F and jump J (ranks per node by default), the W ranks of the
group form W / F cliques of F ranks each, ``n, n + J, ..., n + (F - 1) J`` with
``n = a J F + b`` (``0 <= b < J``). Every member of a clique holds the pieces of all members.
With J = ranks per node, the members sit on F different nodes, so any F - 1 lost nodes leave
one copy of every piece. Example, W = 8, 2 ranks per node, F = 2: cliques {0, 2}, {1, 3},
{4, 6}, {5, 7}; node 1 (ranks 2, 3) holds the pieces of ranks 0, 1, 2 and 3.

Streaming (:func:`stream_files`): files go over the process group in chunks of a bounded size,
all exchanges of a rank posted together (:func:`distckpt.dist.send_recv`), so a rank never holds
more than one chunk per transfer in memory. The receiver writes each chunk to a temporary file
as it arrives and keeps the file (renamed into place) only if its size and CRC32C are what the
sender announced.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from distckpt import containment, dist
from distckpt.core import CheckpointingException, fsync_dir, write_all
from distckpt.formats.manifest import crc32c
from distckpt.io.byteio import byte_view, pread_exact

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class CliqueReplication:
    """Cliques of ``factor`` ranks, ``jump`` ranks apart (see the module docstring).

    ``factor`` 1 means no replication: every rank keeps its own piece only.
    """

    factor: int
    jump: int

    def check(self, world: int, node_size: int) -> None:
        """Raise unless the cliques tile ``world`` ranks and put every member on its own node.

        Raises:
            CheckpointingException: naming the parameters and the offending clique.
        """
        if self.factor < 1 or self.jump < 1 or node_size < 1:
            raise CheckpointingException(
                f"replication factor ({self.factor}), jump ({self.jump}) and node size ({node_size}) "
                f"must be >= 1"
            )
        if world % (self.factor * self.jump):
            raise CheckpointingException(
                f"world size {world} is not divisible by replication factor {self.factor} x jump {self.jump}"
            )
        for rank in range(world):
            clique = self.clique_of(rank)
            nodes = {r // node_size for r in clique}
            if len(nodes) != len(clique):
                raise CheckpointingException(
                    f"replication clique {list(clique)} puts two copies on one node (node size {node_size}); "
                    f"use a replication jump that is a multiple of the node size"
                )

    def clique_of(self, rank: int) -> Tuple[int, ...]:
        """The ranks that hold ``rank``'s piece (``rank`` itself included), in clique order."""
        block = self.factor * self.jump
        base = (rank // block) * block + rank % self.jump
        return tuple(base + k * self.jump for k in range(self.factor))

    def peers(self, rank: int) -> List[Tuple[int, int]]:
        """``(send_to, receive_from)`` for each of the ``factor - 1`` rounds of a ring in the clique."""
        clique = self.clique_of(rank)
        i = clique.index(rank)
        f = len(clique)
        return [(clique[(i + k) % f], clique[(i - k) % f]) for k in range(1, f)]


@dataclass(frozen=True)
class Outgoing:
    """A file this rank sends: to group rank ``peer``; ``size`` and ``crc`` as recorded (None: cannot)."""

    peer: int
    path: Optional[Path]
    size: int
    crc: int


@dataclass(frozen=True)
class Incoming:
    """A file this rank receives from group rank ``peer`` into ``path``."""

    peer: int
    path: Path


@dataclass
class Received:
    """What arrived: ``ok`` when size and CRC32C matched the announcement (file renamed into place)."""

    peer: int
    path: Path
    ok: bool
    size: int = -1
    crc: int = 0
    error: str = ""


def stream_files(
    sends: Sequence[Outgoing],
    recvs: Sequence[Incoming],
    group: dist.ProcessGroup = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> List[Received]:
    """Send and receive whole files in chunks; every rank with a transfer calls it at once.

    Each pair of ranks may have at most one transfer in each direction. First every sender
    announces (size, crc32c) to its receiver, then chunk after chunk flows. A sender that cannot
    read its file (announced size -1, or an I/O error midway) still takes part to the end, so no
    peer waits forever; the receiver then sees a failed transfer, never a wrong file.
    A rank holds at most ``chunk_bytes`` per transfer in memory.

    Returns one :class:`Received` per ``recvs`` entry, in order. Does not raise for a failed
    transfer (the caller agrees on the outcome with a collective); raises only for errors of
    the process group itself.
    """
    device = dist.collective_device(group)
    fds_out: List[Optional[int]] = []
    for s in sends:
        fd = None
        if s.path is not None and s.size > 0:
            try:
                # A piece sent to a peer is opened beneath its folder (a symlink out is refused).
                fd = containment.open_beneath(s.path.parent, s.path.name, s.path.parent, "local piece")
            except (OSError, CheckpointingException) as e:
                logger.warning("cannot read %s to send it to rank %d: %s", s.path, s.peer, e)
        fds_out.append(fd)
    out_sizes = [
        s.size if s.path is not None and (fd is not None or s.size == 0) else -1
        for s, fd in zip(sends, fds_out)
    ]
    announce_out = [
        torch.tensor([size, s.crc], dtype=torch.int64, device=device) for s, size in zip(sends, out_sizes)
    ]
    announce_in = [torch.zeros(2, dtype=torch.int64, device=device) for _ in recvs]
    dist.send_recv(
        [(t, s.peer) for t, s in zip(announce_out, sends)],
        [(t, r.peer) for t, r in zip(announce_in, recvs)],
        group,
    )
    out_sizes = [max(0, size) for size in out_sizes]
    incoming = [(int(t[0]), int(t[1])) for t in announce_in]
    results = [Received(r.peer, r.path, False) for r in recvs]

    fds_in: List[Optional[int]] = []
    tmps: List[Path] = []
    for r, (size, _), res in zip(recvs, incoming, results):
        tmp = r.path.with_name(f".{r.path.name}.tmp")
        tmps.append(tmp)
        fd = None
        if size < 0:
            res.error = f"rank {r.peer} has no readable copy to send"
        else:
            try:
                r.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as e:
                res.error = f"cannot write {tmp}: {e}"
        fds_in.append(fd)

    def buffers(sizes):
        return [torch.empty(min(chunk_bytes, max(size, 0)), dtype=torch.uint8) for size in sizes]

    host_out, host_in = buffers(out_sizes), buffers([size for size, _ in incoming])
    on_device = device.type != "cpu"
    crcs_in = [0] * len(recvs)
    try:
        longest = max([*out_sizes, *(max(size, 0) for size, _ in incoming), 0])
        for start in range(0, longest, chunk_bytes):
            send_ops, recv_ops, landing = [], [], []
            for i, (s, size) in enumerate(zip(sends, out_sizes)):
                if start >= size:
                    continue
                n = min(chunk_bytes, size - start)
                chunk = host_out[i][:n]
                if fds_out[i] is not None:
                    try:
                        pread_exact(fds_out[i], byte_view(chunk), start, str(s.path))
                    except (OSError, CheckpointingException) as e:
                        # Keep sending (whatever the buffer holds): the receiver's CRC32C rejects it.
                        logger.warning("reading %s for rank %d failed: %s", s.path, s.peer, e)
                        os.close(fds_out[i])
                        fds_out[i] = None
                send_ops.append((chunk.to(device) if on_device else chunk, s.peer))
            for i, (r, (size, _)) in enumerate(zip(recvs, incoming)):
                if start >= size:
                    continue
                chunk = host_in[i][: min(chunk_bytes, size - start)]
                target = torch.empty_like(chunk, device=device) if on_device else chunk
                recv_ops.append((target, r.peer))
                landing.append((i, chunk, target))
            dist.send_recv(send_ops, recv_ops, group)
            for i, chunk, target in landing:
                if on_device:
                    chunk.copy_(target)
                view = byte_view(chunk)
                crcs_in[i] = crc32c(view, crcs_in[i])
                if fds_in[i] is not None:
                    try:
                        write_all(fds_in[i], view)
                    except OSError as e:
                        results[i].error = f"writing {tmps[i]} failed: {e}"
                        os.close(fds_in[i])
                        fds_in[i] = None
        for i, (r, (size, crc)) in enumerate(zip(recvs, incoming)):
            fd, res = fds_in[i], results[i]
            if fd is None:
                continue
            try:
                os.fsync(fd)
            except OSError as e:
                res.error = f"fsync of {tmps[i]} failed: {e}"
            os.close(fd)
            fds_in[i] = None
            if res.error:
                continue
            if crcs_in[i] != crc:
                res.error = (
                    f"the copy of {r.path.name} from rank {r.peer} does not match its CRC32C "
                    f"(announced {crc:#010x}, received {crcs_in[i]:#010x})"
                )
                continue
            os.replace(tmps[i], r.path)
            fsync_dir(r.path.parent)
            res.ok, res.size, res.crc = True, size, crc
    finally:
        for fd in fds_out + fds_in:
            if fd is not None:
                os.close(fd)
        for tmp, res in zip(tmps, results):
            if not res.ok:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    return results
