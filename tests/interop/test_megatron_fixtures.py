"""Checkpoints written by megatron-core itself load bit-exactly, whole and resharded.

The fixtures (tests/data/README.md) hold the checkpoint and the full tensors it must load to.
Each case loads on N gloo ranks, every rank requesting its piece under some layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import dist as ddist
from tests.support.layouts import splits

DATA = Path(__file__).parents[1] / "data"


def _expected(fixture):
    return torch.load(DATA / fixture / "expected.pt", weights_only=True)


def _flat_cuts(numel, dp):
    # Uneven cuts that cross row boundaries: shift every inner cut by one element.
    cuts = [0] + [min(numel, (i * numel) // dp + 1) for i in range(1, dp)] + [numel]
    return sorted(cuts)


def _requests(full, rank, world, layout):
    """Return {name: (request, expected local tensor)} for one rank under ``layout``."""
    out = {}
    kind = layout["kind"]
    for key, t in full.items():
        dtype = layout.get("cast", {}).get(t.dtype, t.dtype)
        want_full = t.to(dtype)
        layered = layout.get("layers") and key.startswith(layout["layers"]) and t.dim() >= 2
        if kind == "whole" or (kind == "axis" and t.dim() <= layout["axis"]):
            out[key] = (
                ShardedTensor.from_rank_offsets(key, torch.zeros_like(want_full), replica_id=rank),
                want_full,
            )
        elif kind == "axis":
            axis = layout["axis"] if layout["axis"] >= 0 else t.dim() - 1
            off, length = splits(t.shape[axis], world)[rank]
            local = want_full.narrow(axis, off, length).clone()
            goff = [0] * t.dim()
            goff[axis] = off
            out[key] = (
                ShardedTensor(
                    key,
                    torch.zeros_like(local),
                    dtype,
                    tuple(local.shape),
                    tuple(t.shape),
                    tuple(goff),
                    None,
                    0,
                ),
                local,
            )
        elif kind == "grid":
            if t.dim() < 2:
                out[key] = (
                    ShardedTensor.from_rank_offsets(key, torch.zeros_like(want_full), replica_id=rank),
                    want_full,
                )
                continue
            r, c = divmod(rank, 2)
            (ro, rl), (co, cl) = splits(t.shape[0], 2)[r], splits(t.shape[1], 2)[c]
            local = want_full[ro : ro + rl, co : co + cl].clone()
            out[key] = (
                ShardedTensor(
                    key,
                    torch.zeros_like(local),
                    dtype,
                    tuple(local.shape),
                    tuple(t.shape),
                    (ro, co) + (0,) * (t.dim() - 2),
                    None,
                    0,
                ),
                local,
            )
        elif kind == "per_layer":
            if not layered:
                out[key] = (
                    ShardedTensor.from_rank_offsets(key, torch.zeros_like(want_full), replica_id=rank),
                    want_full,
                )
                continue
            first, count = splits(t.shape[0], world)[rank]
            for layer in range(first, first + count):
                local = want_full[layer].clone()
                sh = ShardedTensor.from_rank_offsets(
                    key, torch.zeros_like(local), (0, layer, t.shape[0]), prepend_axis_num=1
                )
                out[f"{key}.{layer}"] = (sh, local)
        elif kind == "flat":
            tp, dp = layout["tp"], world // layout["tp"]
            tp_rank, dp_rank = rank % tp, rank // tp
            prepend = 1 if key in layout.get("prepended", ()) else 0
            layers = range(t.shape[0]) if prepend else [None]
            for layer in layers:
                body = want_full[layer] if prepend else want_full
                rows = body.shape[0] // tp
                chunk = body[tp_rank * rows : (tp_rank + 1) * rows].contiguous()
                cuts = _flat_cuts(chunk.numel(), dp)
                start, stop = cuts[dp_rank], cuts[dp_rank + 1]
                local = chunk.flatten()[start:stop].clone()
                rank_offsets = [(prepend, tp_rank, tp)]
                if prepend:
                    rank_offsets.insert(0, (0, layer, t.shape[0]))
                sh = ShardedTensor.from_rank_offsets_flat(
                    key,
                    torch.zeros_like(local),
                    tuple(chunk.shape),
                    *rank_offsets,
                    flattened_range=slice(start, stop),
                    prepend_axis_num=prepend,
                )
                out[key if layer is None else f"{key}.{layer}"] = (sh, local)
        else:
            raise ValueError(kind)
    return out


def _load_fixture(fixture, layout, with_objects):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    expected = _expected(fixture)
    reqs = _requests(expected["tensors"], rank, world, layout)
    sd = {name: sh for name, (sh, _) in reqs.items()}
    if with_objects:
        for uk in expected["objects"]:
            sd[uk] = ShardedObject.empty_from_unique_key(uk, replica_id=rank)
    loaded = distckpt.load(sd, DATA / fixture / "ckpt")
    wrong = [
        name
        for name, (_, want) in reqs.items()
        if loaded[name].dtype != want.dtype or not torch.equal(loaded[name], want)
    ]
    if with_objects:
        wrong += [uk for uk, obj in expected["objects"].items() if repr(loaded[uk]) != repr(obj)]
    common = {k: v for k, v in loaded.items() if k not in sd}
    return len(reqs), wrong, common == expected["common"]


CASES = [
    ("megatron-0.16.1/tp2_basic", 1, {"kind": "whole"}, True),
    ("megatron-0.16.1/tp2_basic", 2, {"kind": "axis", "axis": -1}, True),  # axes swapped
    ("megatron-0.16.1/tp2_basic", 4, {"kind": "axis", "axis": 0}, True),  # TP4, uneven rows
    ("megatron-0.16.1/tp2_basic", 4, {"kind": "grid"}, True),  # 2x2 grid
    ("megatron-0.16.1/tp2_basic", 3, {"kind": "axis", "axis": 0}, False),  # 3 uneven pieces
    ("megatron-0.16.1/tp2_basic", 1, {"kind": "whole", "cast": {torch.bfloat16: torch.float32}}, False),
    ("megatron-0.16.1/pp_prepend", 1, {"kind": "whole"}, False),  # stacks as one tensor
    ("megatron-0.16.1/pp_prepend", 2, {"kind": "per_layer", "layers": "decoder.layers."}, False),
    ("megatron-0.16.1/pp_prepend", 4, {"kind": "per_layer", "layers": "decoder.layers."}, False),
    ("megatron-0.16.1/flat4", 1, {"kind": "whole"}, False),
    ("megatron-0.16.1/flat4", 2, {"kind": "axis", "axis": 0}, False),
    ("megatron-0.16.1/flat4", 3, {"kind": "axis", "axis": 0}, False),
    ("megatron-0.15.3/flat_dp4_torch_dist", 1, {"kind": "whole"}, True),  # flat -> regular tensors
    ("megatron-0.15.3/flat_dp4_torch_dist", 2, {"kind": "axis", "axis": 0}, True),
    (
        "megatron-0.15.3/flat_dp4_torch_dist",
        2,  # DP2 -> DP1, flat
        {"kind": "flat", "tp": 2, "prepended": ("decoder.layers.fc2.weight",)},
        True,
    ),
    (
        "megatron-0.15.3/flat_dp4_torch_dist",
        4,  # TP2xDP2 -> TP1xDP4
        {"kind": "flat", "tp": 1, "prepended": ("decoder.layers.fc2.weight",)},
        True,
    ),
    (
        "megatron-0.15.3/flat_dp4_torch_dist",
        4,  # same TP/DP, other cuts
        {"kind": "flat", "tp": 2, "prepended": ("decoder.layers.fc2.weight",)},
        True,
    ),
]


@pytest.mark.parametrize(
    "fixture,world,layout,with_objects",
    CASES,
    ids=[f"{c[0].split('/')[1]}-w{c[1]}-{c[2]['kind']}{'-cast' if 'cast' in c[2] else ''}" for c in CASES],
)
def test_megatron_checkpoint_loads_bit_exactly(fixture, world, layout, with_objects):
    results = run(world, fixture, layout, with_objects)
    for count, wrong, common_ok in results:
        assert count > 0
        assert wrong == []
        assert common_ok


def run(world, fixture, layout, with_objects):
    from tests.support.harness import run_ranks

    return run_ranks(world, _load_fixture, fixture, layout, with_objects)


@pytest.mark.parametrize(
    "fixture",
    [
        "megatron-0.16.1/tp2_basic",
        "megatron-0.16.1/pp_prepend",
        "megatron-0.16.1/flat4",
        "megatron-0.15.3/flat_dp4_torch_dist",
    ],
)
def test_metadata_queries_describe_megatron_checkpoints(fixture):
    expected = _expected(fixture)
    ckpt = DATA / fixture / "ckpt"
    meta = distckpt.load_tensors_metadata(ckpt)
    assert {k: (tuple(v.global_shape), v.dtype) for k, v in meta.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in expected["tensors"].items()
    }
    sharded = distckpt.load_sharded_metadata(ckpt)
    assert set(sharded) == set(expected["tensors"]) | set(expected["objects"])
    assert distckpt.load_common_state_dict(ckpt) == expected["common"]
    plain = distckpt.load_plain_tensors(ckpt)
    assert all(torch.equal(plain[k], v) for k, v in expected["tensors"].items())
