"""``distckpt demo``: save under one layout, reload under two others, bit for bit."""

from __future__ import annotations

import torch

from distckpt import ShardedTensor
from distckpt.demo import (
    assemble_reference,
    choose_layouts,
    compare_with_reference,
    main,
    main_replica_pieces,
)
from distckpt.examples.parallel import Layout


def test_demo_on_two_ranks_reloads_bit_exactly_and_prints_the_layouts(tmp_path, capsys):
    assert main(world_size=2, out_dir=tmp_path) == 0
    out = capsys.readouterr().out
    for layout in ("TP2xPP1xDP1", "TP1xPP1xDP2", "TP1xPP2xDP1"):
        assert layout in out
    assert out.count("bit-exact") == 2
    assert (tmp_path / "ckpt" / "metadata.json").exists()


def test_layouts_for_four_ranks_save_with_replicas_and_reload_under_tp4_and_tp1():
    assert choose_layouts(4) == [Layout(2, 1, 2), Layout(4, 1, 1), Layout(1, 1, 4)]


def test_a_single_rank_reloads_under_its_own_layout():
    assert choose_layouts(1) == [Layout(), Layout()]


def _leaves():
    w = torch.arange(12.0).reshape(4, 3)
    return [
        ShardedTensor.from_rank_offsets("w", w[:2].clone(), (0, 0, 2)),
        ShardedTensor.from_rank_offsets("w", w[2:].clone(), (0, 1, 2)),
        ShardedTensor.from_rank_offsets("w", w[2:].clone(), (0, 1, 2), replica_id=1),
        ShardedTensor.from_rank_offsets_flat("m", torch.arange(4.0), (2, 3), flattened_range=slice(0, 4)),
        ShardedTensor.from_rank_offsets_flat(
            "m", torch.arange(4.0, 6.0), (2, 3), flattened_range=slice(4, 6)
        ),
    ]


def test_reference_is_assembled_from_main_replicas_by_plain_indexing():
    reference, badly_covered = assemble_reference(main_replica_pieces(_leaves()))
    assert badly_covered == []
    assert torch.equal(reference["w"], torch.arange(12.0).reshape(4, 3))
    assert torch.equal(reference["m"], torch.arange(6.0).reshape(2, 3))
    assert compare_with_reference(_leaves(), reference) == []


def test_a_flipped_bit_is_a_mismatch():
    reference, _ = assemble_reference(main_replica_pieces(_leaves()))
    leaves = _leaves()
    leaves[4].data.view(torch.int32)[1] ^= 1
    assert compare_with_reference(leaves, reference) == ["m at (0, 0) [4:6]"]


def test_overlapping_saved_pieces_are_reported():
    leaves = _leaves()
    leaves[2].replica_id = 0  # two main replicas of the same rows
    _, badly_covered = assemble_reference(main_replica_pieces(leaves))
    assert badly_covered == ["w"]
