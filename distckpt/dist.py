"""The one place that talks to torch.distributed; every helper also works with no process group.

Without an initialized process group the world is a single rank 0 and every collective is the
identity, so the whole library runs in one plain process too.

Error agreement: a stage of a save or load ends with :func:`sync_errors`, which gathers every
rank's exception (or None) and raises the *same* :class:`CheckpointingException` on every rank
when any rank failed. No rank is ever left waiting in a collective that a failed rank skipped,
because each rank reaches the same ``sync_errors`` call whether its own work failed or not.

No collective waits forever: before each stage's collective every rank checks in on a side
channel that survives a dead peer — the default process group's key-value store (TCPStore,
FileStore), which ``store.wait`` can wait on with a timeout, unlike an NCCL or gloo collective.
A rank that died or stopped answering makes every surviving rank raise the same
:class:`CollectiveTimeout` (a CheckpointingException naming the stage and the ranks that did not
arrive) within :func:`collective_timeout` seconds. Set it with the environment variable
``DISTCKPT_COLLECTIVE_TIMEOUT`` (seconds) or :func:`set_collective_timeout`; by default the
smaller of 300 s and the process group's own timeout. On a TCPStore a dead rank is named sooner:
every process beats on the store once a second (a daemon thread started at import), and a rank
awaited at a stage whose heartbeat stood still for :func:`heartbeat_grace` seconds (default 10;
``DISTCKPT_HEARTBEAT_GRACE``) is dead; a live but slow rank gets the whole timeout (see the
heartbeat in :mod:`distckpt.heartbeat`).
The first rank to time out words the verdict into the store, and every rank — also one that
arrives late — raises that same message. Cost: four store round trips per stage (never per
tensor), plus deleting the previous stage's keys. The collective itself is bounded too: on
gloo (and any backend but NCCL, whose watchdog owns its timeouts) every rank waits for it at most
:func:`collective_timeout` seconds, so a rank that checked in and then stalled, or a survivor left
waiting on a peer that gave up, cannot hold the others to the process group's own timeout (30
minutes by default). A collective that fails
after every rank checked in (a peer died inside it; gloo notices a closed connection; the bounded
wait ran out) is turned
into a CollectiveTimeout naming the stage, and its message is posted to the group's next
check-in, so that the ranks the failure did not reach raise the same message at their next stage. A rank
that raised a verdict re-raises it at once at any later stage of the same operation (a failure is
shared at the next stage; that stage must not wait for ranks that gave up).

On a store that wakes its waiters (TCPStore) the object stages — :func:`gather_and_decide`,
:func:`all_gather_or_raise` (and so :func:`sync_errors`), :func:`all_reduce_max` — run through the
store alone (:func:`store_rounds`, :func:`_store_round`): each rank posts its payload under the
stage's number, rank 0 waits for them all with the timeout, decides and posts the outcome, the
others wait for that with the timeout. Check-in and stage are one; no rank is ever inside a
collective of the process group, so a stage that timed out leaves the group usable.

Layers: :mod:`distckpt.process_group` (ranks, settings, the exceptions), :mod:`distckpt.heartbeat`
(the dead-rank watch), :mod:`distckpt.checkin` (check-ins, verdicts, the bounded wait for a
collective, the store rounds) and this module, the collectives and the error agreement built on
them. Every public name of those layers is importable from here, as before.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as tdist

from distckpt.checkin import (
    STORE_ROUNDS_ENV,
    check_in,
    guarded,
    reset_failures,
    run_bounded,
    store_round,
    store_rounds,
    wait_bounded,
)
from distckpt.core import CheckpointingException
from distckpt.process_group import (
    DEFAULT_HEARTBEAT_GRACE_S,
    DEFAULT_TIMEOUT_S,
    HEARTBEAT_GRACE_ENV,
    TIMEOUT_ENV,
    CollectiveTimeout,
    ProcessGroup,
    RankErrors,
    collective_device,
    collective_timeout,
    describe_error,
    get_rank,
    get_world_size,
    global_rank_of,
    group_ranks,
    heartbeat_grace,
    is_initialized,
    one_line,
    set_collective_timeout,
    set_heartbeat_grace,
)

__all__ = [
    "CollectiveTimeout",
    "DEFAULT_HEARTBEAT_GRACE_S",
    "DEFAULT_TIMEOUT_S",
    "HEARTBEAT_GRACE_ENV",
    "ProcessGroup",
    "RankErrors",
    "STORE_ROUNDS_ENV",
    "T",
    "TIMEOUT_ENV",
    "all_gather",
    "all_gather_object",
    "all_gather_or_raise",
    "all_reduce_max",
    "barrier",
    "broadcast",
    "broadcast_object",
    "check_in",
    "collective_device",
    "collective_timeout",
    "describe_error",
    "gather_and_decide",
    "gather_object",
    "get_rank",
    "get_world_size",
    "global_rank_of",
    "heartbeat_grace",
    "is_initialized",
    "reset_failures",
    "send_recv",
    "set_collective_timeout",
    "set_heartbeat_grace",
    "store_rounds",
]

T = TypeVar("T")


def _store_round(
    store, stage: str, group: ProcessGroup, blob: bytes, decide: Callable[[List[bytes]], bytes]
) -> bytes:
    """:func:`distckpt.checkin.store_round`, with an outcome too large for the store taken from
    the broadcast that follows it."""
    follows, result = store_round(store, stage, group, blob, decide)
    if follows:
        return guarded(stage, lambda: _broadcast_object(bytes(result), 0, group), group)
    return result


# Object collectives and ``all_reduce_max`` check in first (``checked``) under the name of their
# ``stage``; the tensor collectives ``broadcast`` and ``all_gather`` are called per piece by the
# fully parallel exchange, which checks in once before it starts.


def barrier(group: ProcessGroup = None, stage: str = "barrier", checked: bool = True) -> None:
    if is_initialized():
        if checked:
            check_in(stage, group)
        guarded(stage, lambda: run_bounded(tdist.barrier, group=group), group)


# Object collectives send each rank's pickle in a fixed slot of ``slot_bytes(world)`` bytes (an
# 8-byte length, then the pickle when it fits): the small payloads of most stages (no error, a
# digest, a staging path) take one collective instead of torch's two (sizes first, then the
# padded pickles). A payload too large for its slot goes in a second round, as torch does.
_LEN = 8


def slot_bytes(world: int) -> int:
    return max(64, min(1024, (1 << 20) // max(1, world)))


def _pack(obj: Any, slot: int, device: torch.device) -> Tuple[torch.Tensor, bytes]:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = bytearray(slot)
    buf[:_LEN] = len(data).to_bytes(_LEN, "little")
    if len(data) <= slot - _LEN:
        buf[_LEN : _LEN + len(data)] = data
    return torch.frombuffer(buf, dtype=torch.uint8).to(device), data


def _length(slot: torch.Tensor) -> int:
    return int.from_bytes(slot[:_LEN].cpu().numpy().tobytes(), "little")


def _unpack(slot_bytes: bytes, length: int) -> Any:
    return pickle.loads(slot_bytes[_LEN : _LEN + length])


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    buf = bytearray(size)
    buf[: len(data)] = data
    return torch.frombuffer(buf, dtype=torch.uint8).to(device)


def _slot_round(obj: Any, group: ProcessGroup):
    """The first round of both object collectives: every rank's pickle (or, when it does not fit
    the fixed slot, its length) all-gathered in slots. Returns the world size, the collective
    device, the slot size, this rank's pickle, every rank's slot bytes and pickle length."""
    world, device = get_world_size(group), collective_device(group)
    slot = slot_bytes(world)
    mine, data = _pack(obj, slot, device)
    slots = [torch.empty(slot, dtype=torch.uint8, device=device) for _ in range(world)]
    run_bounded(tdist.all_gather, slots, mine, group=group)
    raw = [t.cpu().numpy().tobytes() for t in slots]
    return world, device, slot, data, raw, [int.from_bytes(r[:_LEN], "little") for r in raw]


def _all_gather_object(obj: Any, group: ProcessGroup) -> List[Any]:
    world, device, slot, data, raw, lengths = _slot_round(obj, group)
    longest = max(lengths)
    if longest <= slot - _LEN:
        return [_unpack(r, n) for r, n in zip(raw, lengths)]
    full = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    run_bounded(tdist.all_gather, full, _padded(data, longest, device), group=group)
    return [pickle.loads(t.cpu().numpy().tobytes()[:n]) for t, n in zip(full, lengths)]


def _gather_object(obj: Any, dst: int, group: ProcessGroup) -> Optional[List[Any]]:
    """Every rank learns the lengths (first round, an all-gather of the slots); payloads that do
    not fit their slot then go to ``dst`` alone in a second round (a gather)."""
    world, device, slot, data, raw, lengths = _slot_round(obj, group)
    longest = max(lengths)
    me = get_rank(group)
    if longest <= slot - _LEN:
        return [_unpack(r, n) for r, n in zip(raw, lengths)] if me == dst else None
    full = (
        [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)] if me == dst else None
    )
    run_bounded(
        tdist.gather, _padded(data, longest, device), full, dst=global_rank_of(dst, group), group=group
    )
    if me != dst:
        return None
    return [
        _unpack(r, n) if n <= slot - _LEN else pickle.loads(t.cpu().numpy().tobytes()[:n])
        for r, n, t in zip(raw, lengths, full)
    ]


def _broadcast_object(obj: Any, src: int, group: ProcessGroup) -> Any:
    world, device = get_world_size(group), collective_device(group)
    slot = slot_bytes(world)
    me = get_rank(group)
    if me == src:
        buf, data = _pack(obj, slot, device)
    else:
        buf, data = torch.empty(slot, dtype=torch.uint8, device=device), b""
    run_bounded(tdist.broadcast, buf, src=global_rank_of(src, group), group=group)
    length = _length(buf)
    if length <= slot - _LEN:
        return obj if me == src else _unpack(buf.cpu().numpy().tobytes(), length)
    full = (
        _padded(data, length, device) if me == src else torch.empty(length, dtype=torch.uint8, device=device)
    )
    run_bounded(tdist.broadcast, full, src=global_rank_of(src, group), group=group)
    return obj if me == src else pickle.loads(full.cpu().numpy().tobytes())


def all_gather_object(
    obj: T, group: ProcessGroup = None, stage: str = "all-gather", checked: bool = True
) -> List[T]:
    if not is_initialized():
        return [obj]
    if checked:
        check_in(stage, group)
    return guarded(stage, lambda: _all_gather_object(obj, group), group)


def gather_object(
    obj: T, dst: int = 0, group: ProcessGroup = None, stage: str = "gather", checked: bool = True
) -> Optional[List[T]]:
    """Gather to group rank ``dst``; returns the list there and None elsewhere."""
    if not is_initialized():
        return [obj]
    if checked:
        check_in(stage, group)
    return guarded(stage, lambda: _gather_object(obj, dst, group), group)


def broadcast_object(
    obj: T, src: int = 0, group: ProcessGroup = None, stage: str = "broadcast", checked: bool = True
) -> T:
    if not is_initialized():
        return obj
    if checked:
        check_in(stage, group)
    return guarded(stage, lambda: _broadcast_object(obj, src, group), group)


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup = None) -> None:
    """Broadcast ``tensor`` in place from group rank ``src``; identity without a process group."""
    if is_initialized():
        guarded(
            "broadcast",
            lambda: run_bounded(tdist.broadcast, tensor, src=global_rank_of(src, group), group=group),
            group,
        )


def all_gather(outputs: List[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None) -> None:
    """All-gather ``tensor`` into ``outputs`` (one per group rank)."""
    if not is_initialized():
        outputs[0].copy_(tensor)
        return
    guarded("all-gather", lambda: run_bounded(tdist.all_gather, outputs, tensor, group=group), group)


def all_reduce_max(
    values: Sequence[int], group: ProcessGroup = None, stage: str = "all-reduce", checked: bool = True
) -> List[int]:
    """Element-wise max of small int vectors over the group (one tiny collective)."""
    if not is_initialized():
        return list(values)
    store = store_rounds(group)
    if store is not None:

        def decide(blobs: List[memoryview]) -> bytes:
            vectors = [pickle.loads(b) for b in blobs]
            return pickle.dumps([max(column) for column in zip(*vectors)])

        return pickle.loads(_store_round(store, stage, group, pickle.dumps([int(v) for v in values]), decide))
    if checked:
        check_in(stage, group)
    t = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    guarded(stage, lambda: run_bounded(tdist.all_reduce, t, op=tdist.ReduceOp.MAX, group=group), group)
    return t.tolist()


def _error_record(exc: Optional[BaseException], group: ProcessGroup) -> Optional[tuple]:
    return None if exc is None else (get_rank(group), one_line(exc), describe_error(exc))


class _Pickled:
    """A payload pickled once: pickling it again copies the bytes, unpickling gives the payload."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return pickle.loads, (self.data,)


def _checked_payload(exc: Optional[BaseException], payload: Any) -> tuple:
    """Turn an unpicklable payload into this rank's error *before* any collective, so the
    collective itself cannot fail on one rank and leave the others waiting. The pickle made
    for the check is the one sent."""
    if exc is None and payload is not None and is_initialized():
        try:
            return exc, _Pickled(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
            return e, None
    return exc, payload


def all_gather_or_raise(
    stage: str, exc: Optional[BaseException], payload: Any = None, group: ProcessGroup = None
) -> List[Any]:
    """All-gather ``payload``; raise the same exception on every rank if any rank passed ``exc``.

    Every rank of ``group`` must call this at the same point, whether or not it failed.
    """
    if store_rounds(group) is not None:
        # Rank 0 gathers and hands every rank the list (or None when every payload is None, as
        # for ``sync_errors``: the outcome stays a few bytes).
        payloads = gather_and_decide(
            stage, exc, payload, lambda ps: ps if any(p is not None for p in ps) else None, group
        )
        return payloads if payloads is not None else [None] * get_world_size(group)
    exc, payload = _checked_payload(exc, payload)
    record = (_error_record(exc, group), None if exc is not None else payload)
    gathered = all_gather_object(record, group, stage)
    failures = [err for err, _ in gathered if err is not None]
    if failures:
        _raise_failures(stage, failures, exc, get_world_size(group))
    return [p for _, p in gathered]


def sync_errors(stage: str, exc: Optional[BaseException], group: ProcessGroup = None) -> None:
    """Raise the same exception on every rank if ``exc`` is set on any rank; else return."""
    all_gather_or_raise(stage, exc, None, group)


def gather_and_decide(
    stage: str,
    exc: Optional[BaseException],
    payload: Any,
    decide: Callable[[List[Any]], Any],
    group: ProcessGroup = None,
) -> Any:
    """Gather ``payload`` (or this rank's error) to rank 0, run ``decide`` there, share the outcome.

    ``decide(payloads)`` runs on group rank 0 only, and only if no rank failed; its return value
    is broadcast and returned on every rank. If any rank failed, or ``decide`` raised, every rank
    raises the same :class:`RankErrors`. Costs one gather and one broadcast.
    """
    exc, payload = _checked_payload(exc, payload)
    record = (_error_record(exc, group), None if exc is not None else payload)

    def outcome_of(gathered: List[tuple]) -> tuple:
        failures = [err for err, _ in gathered if err is not None]
        if not failures:
            try:
                return "ok", decide([p for _, p in gathered])
            except Exception as e:  # noqa: BLE001 - reported to every rank
                failures = [(get_rank(group), one_line(e), describe_error(e))]
        return "failed", failures

    store = store_rounds(group)
    if store is not None:
        outcome = _round_of_records(store, stage, group, record, outcome_of)
    else:
        gathered = gather_object(record, dst=0, group=group, stage=stage)
        outcome = None if gathered is None else outcome_of(gathered)
        outcome = broadcast_object(outcome, src=0, group=group, stage=stage, checked=False)
    if outcome[0] == "ok":
        return outcome[1]
    _raise_failures(stage, outcome[1], exc, get_world_size(group))


def _round_of_records(
    store, stage: str, group: ProcessGroup, record: tuple, outcome_of: Callable[[List[tuple]], tuple]
) -> tuple:
    """A :func:`_store_round` of picklable records: rank 0 unpickles them (a record it cannot
    unpickle is that rank's failure) and every rank gets ``outcome_of(records)`` (a tuple whose
    first item is "ok" or "failed"). A failure to pickle the outcome is rank 0's failure."""
    ranks = group_ranks(group)

    def decide(blobs: List[memoryview]) -> bytes:
        records, failures = [], []
        for r, b in enumerate(blobs):
            try:
                records.append(pickle.loads(b))
            except Exception as e:  # noqa: BLE001 - e.g. a class rank 0 cannot import
                failures.append(
                    (
                        r,
                        f"its payload cannot be unpickled on rank {ranks[0]}: {one_line(e)}",
                        describe_error(e),
                    )
                )
        outcome = ("failed", failures) if failures else outcome_of(records)
        try:
            return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            return pickle.dumps(
                ("failed", [(0, f"the outcome cannot be pickled: {one_line(e)}", describe_error(e))]),
                protocol=pickle.HIGHEST_PROTOCOL,
            )

    mine = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.loads(_store_round(store, stage, group, mine, decide))


def _raise_failures(stage: str, failures: list, exc: Optional[BaseException], world: int) -> None:
    errors = {r: m for r, m, _ in failures}
    tracebacks = {r: t for r, _, t in failures}
    if exc is not None and isinstance(exc, CheckpointingException):
        # Already the same error everywhere (e.g. a strategy that synced its own failure), or a
        # single process: raise it as it is rather than wrapped once more.
        if not is_initialized() or (
            len(failures) == world and isinstance(exc, RankErrors) and len(set(errors.values())) == 1
        ):
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
    guarded("point-to-point exchange", lambda: wait_bounded(tdist.batch_isend_irecv(ops), group), group)
