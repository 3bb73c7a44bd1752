"""The one place that talks to torch.distributed; every helper also works with no process group.

Without an initialized process group the world is a single rank 0 and every collective is the
identity, so the whole library runs in one plain process too.

Error agreement: a stage of a save or load ends with :func:`sync_errors`, which gathers every
rank's exception (or None) and raises the *same* :class:`CheckpointingException` on every rank
when any rank failed. No rank is ever left waiting in a collective that a failed rank skipped,
because each rank reaches the same ``sync_errors`` call whether its own work failed or not.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import torch
import torch.distributed as tdist

from distckpt.core import CheckpointingException

T = TypeVar("T")
ProcessGroup = Optional["tdist.ProcessGroup"]


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def get_rank(group: ProcessGroup = None) -> int:
    return tdist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    return tdist.get_world_size(group) if is_initialized() else 1


def global_rank_of(group_rank: int, group: ProcessGroup = None) -> int:
    if not is_initialized() or group is None:
        return group_rank
    return tdist.get_global_rank(group, group_rank)


def collective_device(group: ProcessGroup = None) -> torch.device:
    """Device for tensors fed to collectives: follows the backend (CPU for gloo, CUDA for NCCL)."""
    if not is_initialized():
        return torch.device("cpu")
    backend = tdist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group: ProcessGroup = None) -> None:
    if is_initialized():
        tdist.barrier(group=group)


def all_gather_object(obj: T, group: ProcessGroup = None) -> List[T]:
    if not is_initialized():
        return [obj]
    out: List[Any] = [None] * get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: T, dst: int = 0, group: ProcessGroup = None) -> Optional[List[T]]:
    """Gather to group rank ``dst``; returns the list there and None elsewhere."""
    if not is_initialized():
        return [obj]
    world = get_world_size(group)
    me = get_rank(group)
    out: Optional[List[Any]] = [None] * world if me == dst else None
    tdist.gather_object(obj, out, dst=global_rank_of(dst, group), group=group)
    return out


def broadcast_object(obj: T, src: int = 0, group: ProcessGroup = None) -> T:
    if not is_initialized():
        return obj
    holder = [obj]
    tdist.broadcast_object_list(holder, src=global_rank_of(src, group), group=group)
    return holder[0]


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup = None) -> None:
    """Broadcast ``tensor`` in place from group rank ``src``; identity without a process group."""
    if is_initialized():
        tdist.broadcast(tensor, src=global_rank_of(src, group), group=group)


def all_gather(outputs: List[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None) -> None:
    """All-gather ``tensor`` into ``outputs`` (one per group rank)."""
    if not is_initialized():
        outputs[0].copy_(tensor)
        return
    tdist.all_gather(outputs, tensor, group=group)


def all_reduce_max(values: Sequence[int], group: ProcessGroup = None) -> List[int]:
    """Element-wise max of small int vectors over the group (one tiny collective)."""
    if not is_initialized():
        return list(values)
    t = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
    return t.tolist()


def describe_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


class RankErrors(CheckpointingException):
    """Raised on every rank when at least one rank failed a stage.

    Attributes:
        stage: which stage failed (e.g. "validation", "write", "commit").
        errors: rank -> one-line error message of that rank.
        tracebacks: rank -> full traceback text of that rank.
    """

    def __init__(self, stage: str, errors: dict, tracebacks: dict):
        self.stage = stage
        self.errors = errors
        self.tracebacks = tracebacks
        if len(set(errors.values())) == 1:
            ranks = ", ".join(map(str, sorted(errors)))
            msg = f"{stage} failed on rank(s) {ranks}: {next(iter(errors.values()))}"
        else:
            lines = [f"rank {r}: {m}" for r, m in sorted(errors.items())]
            msg = f"{stage} failed on {len(errors)} rank(s):\n  " + "\n  ".join(lines)
        super().__init__(msg)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, RankErrors):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, CheckpointingException) else text


def _error_record(exc: Optional[BaseException], group: ProcessGroup) -> Optional[tuple]:
    return None if exc is None else (get_rank(group), _one_line(exc), describe_error(exc))


def _checked_payload(exc: Optional[BaseException], payload: Any) -> tuple:
    """Turn an unpicklable payload into this rank's error *before* any collective, so the
    collective itself cannot fail on one rank and leave the others waiting."""
    if exc is None and payload is not None and is_initialized():
        try:
            pickle.dumps(payload)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
            return e, None
    return exc, payload


def all_gather_or_raise(stage: str, exc: Optional[BaseException], payload: Any = None,
                        group: ProcessGroup = None) -> List[Any]:
    """All-gather ``payload``; raise the same exception on every rank if any rank passed ``exc``.

    Every rank of ``group`` must call this at the same point, whether or not it failed.
    """
    exc, payload = _checked_payload(exc, payload)
    gathered = all_gather_object((_error_record(exc, group), None if exc is not None else payload), group)
    failures = [err for err, _ in gathered if err is not None]
    if failures:
        _raise_failures(stage, failures, exc, get_world_size(group))
    return [p for _, p in gathered]


def sync_errors(stage: str, exc: Optional[BaseException], group: ProcessGroup = None) -> None:
    """Raise the same exception on every rank if ``exc`` is set on any rank; else return."""
    all_gather_or_raise(stage, exc, None, group)


def gather_and_decide(stage: str, exc: Optional[BaseException], payload: Any,
                      decide: Callable[[List[Any]], Any], group: ProcessGroup = None) -> Any:
    """Gather ``payload`` (or this rank's error) to rank 0, run ``decide`` there, share the outcome.

    ``decide(payloads)`` runs on group rank 0 only, and only if no rank failed; its return value
    is broadcast and returned on every rank. If any rank failed, or ``decide`` raised, every rank
    raises the same :class:`RankErrors`. Costs one gather and one broadcast.
    """
    exc, payload = _checked_payload(exc, payload)
    gathered = gather_object((_error_record(exc, group), None if exc is not None else payload),
                             dst=0, group=group)
    outcome: Any = None
    if gathered is not None:
        failures = [err for err, _ in gathered if err is not None]
        if not failures:
            try:
                outcome = ("ok", decide([p for _, p in gathered]))
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                failures = [(get_rank(group), _one_line(e), describe_error(e))]
        if failures:
            outcome = ("failed", failures)
    outcome = broadcast_object(outcome, src=0, group=group)
    if outcome[0] == "ok":
        return outcome[1]
    _raise_failures(stage, outcome[1], exc, get_world_size(group))


def _raise_failures(stage: str, failures: list, exc: Optional[BaseException], world: int) -> None:
    errors = {r: m for r, m, _ in failures}
    tracebacks = {r: t for r, _, t in failures}
    if exc is not None and isinstance(exc, CheckpointingException):
        # Already the same error everywhere (e.g. a strategy that synced its own failure), or a
        # single process: raise it as it is rather than wrapped once more.
        if not is_initialized() or (len(failures) == world and isinstance(exc, RankErrors)
                                    and len(set(errors.values())) == 1):
            raise exc
    raise RankErrors(stage, errors, tracebacks) from exc


# --------------------------------------------------------------------------- point to point


def send_recv(sends: Sequence[tuple], recvs: Sequence[tuple], group: ProcessGroup = None) -> None:
    """Post every send and receive at once, then wait for all of them.

    ``sends`` and ``recvs`` hold ``(tensor, peer)`` pairs, ``peer`` a rank of ``group``. Tensors
    live on :func:`collective_device` (CPU for gloo, CUDA for NCCL). Messages between two ranks
    are matched in the order they were posted, so both sides must list their exchanges with one
    another in the same order. Posting everything before waiting is what makes a ring or any
    other pattern of simultaneous exchanges free of deadlock. Without a process group only the
    empty exchange is allowed.
    """
    if not sends and not recvs:
        return
    if not is_initialized():
        raise CheckpointingException("point-to-point transfer needs an initialized process group")
    ops = [tdist.P2POp(tdist.isend, t, global_rank_of(peer, group), group) for t, peer in sends]
    ops += [tdist.P2POp(tdist.irecv, t, global_rank_of(peer, group), group) for t, peer in recvs]
    for work in tdist.batch_isend_irecv(ops):
        work.wait()
