"""The local tier: node-local checkpoints replicated to peers, recovered on real gloo ranks.

Four ranks on simulated nodes of two ranks each (node ``n`` = ranks ``2n, 2n+1``, each node its
own directory ``<tmp>/node<n>``), replication factor 2: cliques {0, 2} and {1, 3}, so node 0
holds the pieces of ranks 0, 1 (own) and 2, 3 (replicas), node 1 the other way round.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from distckpt import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from distckpt import dist as ddist
from distckpt.core import CheckpointingException
from distckpt.local import CliqueReplication, LocalCheckpointManager
from distckpt.local import manager as local_manager
from distckpt.local.manager import iteration_dir, piece_name
from distckpt.strategies.async_utils import AsyncCallsQueue
from tests.support import faults, layouts
from tests.support.faults import flip_byte
from tests.support.harness import RankFailure, expect_all_ranks_raise, run_ranks

WORLD = 4
NODE = 2
TIMEOUT = 60


# --------------------------------------------------------------------------- the state


def _generation(piece: layouts.Piece, generation: int) -> torch.Tensor:
    return dataclasses.replace(piece, key=f"{piece.key}@{generation}").expected()


def _split_rows(key, data, replica_id, flattened_range):
    half = data.shape[0] // 2
    return {
        name: ShardedTensor.from_rank_offsets(f"{key}.{name}", part, replica_id=replica_id)
        for name, part in (("a", data[:half]), ("b", data[half:]))
    }


def _merge_rows(loaded):
    return torch.cat([loaded["a"], loaded["b"]])


def state(rank: int, world: int, generation: int, with_data: bool = True) -> dict:
    """A TP/DP model, distributed-optimizer flat slices, a factory, an object, a non-persistent
    value and common state, every value depending on ``generation`` (keys do not)."""
    sd = faults.generation_state(rank, world, generation, with_data)
    for piece in layouts.flat_optimizer(rank, world, tp=2):
        sh = piece.sharded(with_data=False)
        if with_data:
            sh.data = _generation(piece, generation)
        sd[f"opt.{piece.name}"] = sh
    fused = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * generation + rank
    sd["fused"] = ShardedTensorFactory(
        f"fused{rank}", fused if with_data else torch.zeros(4, 3), _split_rows, _merge_rows
    )
    sd["scratch"] = LocalNonpersistentObject({"not": "saved", "rank": rank})
    return sd


def mismatches(loaded: dict, rank: int, world: int, generation: int) -> list:
    wrong = faults.generation_mismatches(loaded, rank, world, generation)
    for piece in layouts.flat_optimizer(rank, world, tp=2):
        if not layouts.bitwise_equal(loaded[f"opt.{piece.name}"], _generation(piece, generation)):
            wrong.append(f"opt.{piece.name}")
    if not torch.equal(
        loaded["fused"], torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * generation + rank
    ):
        wrong.append("fused")
    if loaded["scratch"] != {"not": "saved", "rank": rank}:
        wrong.append("scratch")
    return wrong


# --------------------------------------------------------------------------- rank functions


def _manager(root: str, **kwargs) -> LocalCheckpointManager:
    rank = ddist.get_rank()
    kwargs.setdefault("chunk_bytes", 1000)  # several chunks per piece: the chunked path is exercised
    return LocalCheckpointManager(
        Path(root) / f"node{rank // NODE}", node_size=NODE, replication_factor=2, **kwargs
    )


def _save(
    root: str, generations, is_async: bool = False, background: bool = False, failing: int = -1
) -> None:
    """Save ``generations`` in turn; ``background``: async saves replicate in the worker thread
    over a group of their own; ``failing``: that rank's piece writes raise ENOSPC."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    manager = _manager(
        root, replication_group=torch.distributed.new_group(backend="gloo") if background else None
    )
    queue = AsyncCallsQueue() if is_async else None

    def no_space(piece, path):
        raise OSError(28, f"No space left on device (injected on rank {rank})")

    with faults.patched(
        local_manager, "write_piece", no_space if rank == failing else local_manager.write_piece
    ):
        for g in generations:
            request = manager.save(state(rank, world, g), g, is_async=is_async)
            if queue is not None:
                queue.schedule_async_request(request)  # not finalized yet: saves overlap
        if queue is not None:
            queue.close()  # finalizes them in order


def _restore(root: str):
    """(latest, source, mismatches, filled in place) on this rank; latest None if nothing.

    The request's tensors are zeros (``with_data=False``): the loaded ones must be those very
    tensors, filled in place."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    manager = _manager(root)
    latest = manager.find_latest()
    if latest is None:
        return None, None, [], False
    request = state(rank, world, 0, with_data=False)
    target = request["col"].data
    loaded = manager.load(request)
    return latest, manager.last_load.source, mismatches(loaded, rank, world, latest), loaded["col"] is target


def _load_without_find(root: str):
    manager = _manager(root)
    return manager.load(state(ddist.get_rank(), ddist.get_world_size(), 0, with_data=False))


def _load_with_extra_key(root: str):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    request = state(rank, world, 0, with_data=False)
    request["unknown"] = ShardedTensor.from_rank_offsets("unknown", torch.zeros(2), replica_id=rank)
    return _manager(root).load(request)


def _save_and_die(root: str, victim: int, window: str) -> None:
    """Save generation 2 while ``victim`` is SIGKILLed: halfway through writing its piece
    (``window="write"``), or after replication, just before its commit marker (``"commit"``)."""
    rank, world = ddist.get_rank(), ddist.get_world_size()

    def half_then_die(piece, path):
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(piece.header)
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    manager = _manager(root)
    if rank != victim:
        manager.save(state(rank, world, 2), 2)
    elif window == "write":
        with faults.patched(local_manager, "write_piece", half_then_die):
            manager.save(state(rank, world, 2), 2)
    else:
        manager._write_marker = die
        manager.save(state(rank, world, 2), 2)


# --------------------------------------------------------------------------- tests


def _stream(root: str):
    """Rank 0 sends rank 1 three files in chunks of 1000 bytes: an intact one, one announced with
    a wrong CRC32C, one it cannot read. Rank 1 returns (ok, error) of each and what it kept."""
    from distckpt.formats.manifest import crc32c
    from distckpt.local.replication import Incoming, Outgoing, stream_files

    base = Path(root)
    data = bytes(range(256)) * 20
    sends = [
        Outgoing(1, base / "good", len(data), crc32c(data)),
        Outgoing(1, base / "good", len(data), crc32c(data) ^ 1),
        Outgoing(1, base / "missing", 5000, 0),
    ]
    out = []
    if ddist.get_rank() == 0:
        (base / "good").write_bytes(data)
    ddist.barrier()
    for i, send in enumerate(sends):
        if ddist.get_rank() == 0:
            stream_files([send], [], chunk_bytes=1000)
        else:
            (got,) = stream_files([], [Incoming(0, base / "in" / f"copy{i}")], chunk_bytes=1000)
            out.append((got.ok, got.error))
    if ddist.get_rank() == 1:
        kept = sorted(p.name for p in (base / "in").iterdir())
        return out, kept, (base / "in" / "copy0").read_bytes() == data
    return None


def test_streamed_files_are_kept_only_when_complete_and_matching_their_crc32c(tmp_path):
    _, (results, kept, same) = run_ranks(2, _stream, str(tmp_path), timeout=TIMEOUT)
    assert results[0] == (True, "")
    assert results[1][0] is False and "does not match its CRC32C" in results[1][1]
    assert results[2] == (False, "rank 0 has no readable copy to send")
    assert kept == ["copy0"] and same


def _node(tmp_path: Path, n: int) -> Path:
    return tmp_path / f"node{n}"


def test_clique_plan_spreads_copies_over_nodes():
    plan = CliqueReplication(factor=2, jump=2)
    plan.check(8, node_size=2)
    assert [plan.clique_of(r) for r in range(8)] == [
        (0, 2),
        (1, 3),
        (0, 2),
        (1, 3),
        (4, 6),
        (5, 7),
        (4, 6),
        (5, 7),
    ]
    assert plan.peers(2) == [(0, 0)]
    three = CliqueReplication(factor=3, jump=2)
    assert three.clique_of(3) == (1, 3, 5)
    assert three.peers(3) == [(5, 1), (1, 5)]
    with pytest.raises(CheckpointingException, match="not divisible"):
        plan.check(6, node_size=2)
    with pytest.raises(CheckpointingException, match="two copies on one node"):
        CliqueReplication(factor=2, jump=1).check(4, node_size=2)


def test_a_single_process_saves_and_restores_without_a_process_group(tmp_path):
    manager = LocalCheckpointManager(tmp_path, replication_factor=1)
    manager.save(state(0, 1, 7), 7)
    with pytest.raises(CheckpointingException, match="iteration 6 is not after the last one saved"):
        manager.save(state(0, 1, 6), 6)
    request = state(0, 1, 0, with_data=False)
    assert manager.find_latest() == 7
    assert mismatches(manager.load(request), 0, 1, 7) == []
    assert manager.last_load.source == "local"


def test_saves_keep_only_the_last_iteration_with_a_replica_of_every_peer(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1, 2], timeout=TIMEOUT)
    for n, own, replicas in ((0, (0, 1), (2, 3)), (1, (2, 3), (0, 1))):
        node = _node(tmp_path, n)
        assert sorted(p.name for p in node.iterdir()) == ["iter_0000000002"]
        expected = {piece_name(r, r) for r in own} | {piece_name(o, h) for o, h in zip(replicas, own)}
        expected |= {f"holder{r:05d}.json" for r in own}
        assert sorted(p.name for p in iteration_dir(node, 2).iterdir()) == sorted(expected)
        for o, h in zip(replicas, own):  # a replica is the owner's file, byte for byte
            other = _node(tmp_path, 1 - n)
            assert (iteration_dir(node, 2) / piece_name(o, h)).read_bytes() == (
                iteration_dir(other, 2) / piece_name(o, o)
            ).read_bytes()


def test_restores_bit_exactly_from_own_copies_in_place(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1, 2], timeout=TIMEOUT)
    results = run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT)
    assert results == [(2, "local", [], True)] * WORLD


def test_overlapping_async_saves_through_the_queue_keep_the_newest(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [3, 5], True, timeout=TIMEOUT)
    assert sorted(p.name for p in _node(tmp_path, 0).iterdir()) == ["iter_0000000005"]
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(5, "local", [], True)] * WORLD


def test_async_saves_replicating_in_the_background_restore(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [3, 5], True, True, timeout=TIMEOUT)
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(5, "local", [], True)] * WORLD


def test_a_failed_background_write_fails_every_rank_and_keeps_the_previous_iteration(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    expect_all_ranks_raise(
        WORLD,
        _save,
        str(tmp_path),
        [2],
        True,
        True,
        1,
        match=r"rank\(s\) 1: OSError: \[Errno 28\] No space left on device",
        timeout=TIMEOUT,
    )
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(1, "local", [], True)] * WORLD


def _fail_async_then_save_again(root: str, iteration: int) -> str:
    """An async save of ``iteration`` whose write fails on rank 1, then the same iteration again."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    manager, queue = _manager(root), AsyncCallsQueue()

    def no_space(piece, path):
        raise OSError(28, "No space left on device (injected)")

    with faults.patched(local_manager, "write_piece", no_space if rank == 1 else local_manager.write_piece):
        queue.schedule_async_request(manager.save(state(rank, world, iteration), iteration, is_async=True))
        try:
            queue.maybe_finalize_async_calls(blocking=True)
            first = "committed"
        except CheckpointingException as e:
            first = type(e).__name__
    manager.save(state(rank, world, iteration), iteration)
    return first


def test_an_iteration_whose_async_write_failed_can_be_saved_again(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    assert (
        run_ranks(WORLD, _fail_async_then_save_again, str(tmp_path), 2, timeout=TIMEOUT)
        == ["RankErrors"] * WORLD
    )
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(2, "local", [], True)] * WORLD


def test_replaced_node_recovers_bit_exactly_from_peers_and_is_healed(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    shutil.rmtree(_node(tmp_path, 1))
    results = run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT)
    assert results == [
        (1, "local", [], True),
        (1, "local", [], True),
        (1, "rank 0", [], True),
        (1, "rank 1", [], True),
    ]
    healed = iteration_dir(_node(tmp_path, 1), 1)
    for r in (2, 3):
        assert (healed / piece_name(r, r)).read_bytes() == (
            iteration_dir(_node(tmp_path, 0), 1) / piece_name(r, r - 2)
        ).read_bytes()
    # Healed copies are committed: the next recovery needs no peer.
    assert [r[1] for r in run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT)] == ["local"] * WORLD


def test_corrupt_own_copy_is_detected_by_crc32c_and_replaced_by_a_peers(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    own = iteration_dir(_node(tmp_path, 0), 1) / piece_name(1, 1)
    replica = iteration_dir(_node(tmp_path, 1), 1) / piece_name(1, 3)
    flip_byte(own, own.stat().st_size // 2)
    assert own.read_bytes() != replica.read_bytes()
    results = run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT)
    assert [r[:3] for r in results] == [
        (1, "local", []),
        (1, "rank 3", []),
        (1, "local", []),
        (1, "local", []),
    ]
    assert own.read_bytes() == replica.read_bytes()


def _rejected(root: str):
    manager = _manager(root)
    manager.load(state(ddist.get_rank(), ddist.get_world_size(), 0, with_data=False))
    return manager.last_load.rejected


def test_corruption_report_names_the_file_and_the_crc32c(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    own = iteration_dir(_node(tmp_path, 1), 1) / piece_name(2, 2)
    flip_byte(own, own.stat().st_size - 5)
    rejected = run_ranks(WORLD, _rejected, str(tmp_path), timeout=TIMEOUT)
    assert rejected[0] == rejected[1] == rejected[3] == []
    assert len(rejected[2]) == 1 and "CRC32C mismatch" in rejected[2][0] and str(own) in rejected[2][0]


def test_every_copy_corrupt_gives_every_rank_the_same_clear_error(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    for path in (
        iteration_dir(_node(tmp_path, 0), 1) / piece_name(0, 0),
        iteration_dir(_node(tmp_path, 1), 1) / piece_name(0, 2),
    ):
        flip_byte(path, 100)
    failure = expect_all_ranks_raise(
        WORLD,
        _load_without_find,
        str(tmp_path),
        match=r"NoLocalCheckpointError: iteration 1: no intact copy of the piece of "
        r"rank\(s\) \[0\]",
        timeout=TIMEOUT,
    )
    assert len({text.strip().splitlines()[-1] for text in failure.errors.values()}) == 1


def test_no_checkpoint_at_all_is_the_same_answer_everywhere(tmp_path):
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(None, None, [], False)] * WORLD
    expect_all_ranks_raise(
        WORLD,
        _load_without_find,
        str(tmp_path),
        match="NoLocalCheckpointError: no iteration restored from the local checkpoints of all 4 "
        "ranks .* fall back to the persistent checkpoint",
        timeout=TIMEOUT,
    )


def test_losing_both_copies_of_a_piece_leaves_nothing_restorable(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    shutil.rmtree(_node(tmp_path, 0))
    os.remove(iteration_dir(_node(tmp_path, 1), 1) / piece_name(0, 2))  # rank 0's last copy
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(None, None, [], False)] * WORLD


def test_a_request_that_differs_from_the_saved_layout_fails_on_every_rank(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    expect_all_ranks_raise(
        WORLD, _load_with_extra_key, str(tmp_path), match="holds no tensor 'unknown'", timeout=TIMEOUT
    )


@pytest.mark.slow
def test_sigkill_while_writing_a_piece_leaves_the_previous_iteration_restorable(tmp_path):
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    with pytest.raises(RankFailure) as failure:
        run_ranks(WORLD, _save_and_die, str(tmp_path), 3, "write", timeout=TIMEOUT)
    assert "killed by signal SIGKILL" in failure.value.errors[3]
    assert (iteration_dir(_node(tmp_path, 1), 2) / f".{piece_name(3, 3)}.tmp").exists()
    assert run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT) == [(1, "local", [], True)] * WORLD


@pytest.mark.slow
def test_sigkill_before_a_commit_marker_keeps_the_old_iteration_and_the_new_one_whole_from_replicas(tmp_path):
    """Every byte of iteration 2 was written and replicated when rank 3 died: its peer's marker
    covers rank 3's piece, so 2 is restorable (rank 3 fetches its piece), and iteration 1 was
    not removed anywhere, because nobody got past the last agreement."""
    run_ranks(WORLD, _save, str(tmp_path), [1], timeout=TIMEOUT)
    with pytest.raises(RankFailure) as failure:
        run_ranks(WORLD, _save_and_die, str(tmp_path), 3, "commit", timeout=TIMEOUT)
    assert "killed by signal SIGKILL" in failure.value.errors[3]
    for n in (0, 1):
        assert (iteration_dir(_node(tmp_path, n), 1) / f"holder{2 * n:05d}.json").exists()
    assert not (iteration_dir(_node(tmp_path, 1), 2) / "holder00003.json").exists()
    results = run_ranks(WORLD, _restore, str(tmp_path), timeout=TIMEOUT)
    assert results == [(2, "local", [], True)] * 3 + [(2, "rank 1", [], True)]


def test_training_restarts_from_the_newer_tier_bitwise_after_losing_a_node(tmp_path):
    from distckpt.examples.training import CheckpointPlan, TrainConfig, last_stage_losses, run_with_recovery

    layout, cfg, total = "TP2xPP1xDP2", TrainConfig(distributed_optimizer=True), 4
    plan = CheckpointPlan(str(tmp_path / "local"), 1, str(tmp_path / "persistent"), 2, node_size=NODE)
    reference = last_stage_losses(
        run_ranks(WORLD, run_with_recovery, layout, total, cfg, CheckpointPlan(), timeout=TIMEOUT)
    )
    run_ranks(WORLD, run_with_recovery, layout, total, cfg, plan, 3, timeout=TIMEOUT)  # "crash" at 3
    shutil.rmtree(tmp_path / "local" / "node1")
    results = run_ranks(WORLD, run_with_recovery, layout, total, cfg, plan, timeout=TIMEOUT)
    assert {(r.first_iteration, r.resumed_from) for r in results} == {(3, "local")}
    assert last_stage_losses(results) == reference[3:]
