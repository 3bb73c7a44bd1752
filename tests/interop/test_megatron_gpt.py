"""Megatron-Core's real GPTModel checkpoints through distckpt, unchanged (needs the ``megatron`` extra).

A tiny GPT (2 layers, hidden 32, Megatron's local layer spec, CPU, gloo) at tensor parallel 2 on
2 ranks hands ``model.sharded_state_dict()`` -- Megatron's own ShardedTensor/ShardedObject
objects -- straight to ``distckpt.save``. The checkpoint then loads bit-exactly into fresh models
at TP=2 and TP=1 with distckpt, and at TP=1 with Megatron-Core's own ``dist_checkpointing.load``.
Skipped when megatron-core is not installed (``pip install -e .[megatron]``).

Running megatron-core on CPU: building the model and Megatron's default torch_dist load need no
patch (the CPU/gloo notes of the interop study, shared/interop/mcore_cpu.py, list what its *save*
and fully parallel paths would need; nothing of it is used here).
"""

from __future__ import annotations

import io

import pytest
import torch

import distckpt
from distckpt import dist as ddist
from distckpt.dict_utils import nested_values
from tests.support.harness import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")

WORLD = 2


def _gpt(tp: int, seed: int):
    """A fresh tiny GPTModel under a fresh tensor-parallel layout of size ``tp``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def _tensors(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _deep_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_deep_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, io.BytesIO):
        return isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue()
    return type(a) is type(b) and a == b


def _round_trip(ckpt: str) -> dict:
    from megatron.core import dist_checkpointing, parallel_state

    try:
        saved = _gpt(tp=2, seed=0)
        sharded = saved.sharded_state_dict()
        leaves = list(nested_values(sharded))
        kinds = sorted({f"{type(x).__module__}.{type(x).__name__}" for x in leaves})
        # Where each TP=2 piece sits in the global tensor, as Megatron declares it.
        pieces = [
            (x.key, tuple(x.global_offset), x.prepend_axis_num, x.data.clone())
            for x in leaves
            if type(x).__name__ == "ShardedTensor"
        ]
        distckpt.save(sharded, ckpt)

        # TP=2 -> TP=2 with distckpt: the returned dict is what model.load_state_dict takes.
        same_layout = _gpt(tp=2, seed=1)
        loaded = distckpt.load(same_layout.sharded_state_dict(), ckpt, strict="raise_all")
        same_layout.load_state_dict(loaded, strict=True)
        tp2_equal = _same(_tensors(same_layout), _tensors(saved))

        # TP=2 -> TP=1: distckpt and Megatron-Core each load into a fresh model.
        ours = _gpt(tp=1, seed=2)
        ours_loaded = distckpt.load(ours.sharded_state_dict(), ckpt, strict="raise_all")
        theirs = _gpt(tp=1, seed=3)
        theirs_loaded = dist_checkpointing.load(theirs.sharded_state_dict(), ckpt)
        same_result = _deep_equal(ours_loaded, theirs_loaded)
        ours.load_state_dict(ours_loaded, strict=True)
        theirs.load_state_dict(theirs_loaded, strict=True)
        tp1_equal = _same(_tensors(ours), _tensors(theirs))

        # Every TP=2 piece of both ranks sits where Megatron said, inside the TP=1 tensors.
        full = {
            (x.key, tuple(x.global_offset[: x.prepend_axis_num])): x.data
            for x in nested_values(ours.sharded_state_dict())
            if type(x).__name__ == "ShardedTensor"
        }
        pieces_ok = True
        for rank_pieces in ddist.all_gather_object(pieces):
            for key, offset, prepend, data in rank_pieces:
                index = tuple(slice(o, o + n) for o, n in zip(offset[prepend:], data.shape))
                pieces_ok &= torch.equal(full[(key, offset[:prepend])][index], data)
        return {
            "leaves": len(leaves),
            "kinds": kinds,
            "tensor_keys": len(distckpt.load_tensors_metadata(ckpt)),
            "all_keys": len(distckpt.load_sharded_metadata(ckpt)),
            "plain_keys": len(distckpt.load_plain_tensors(ckpt)),
            "tp2_equal": tp2_equal,
            "tp1_equal": tp1_equal,
            "same_result": same_result,
            "pieces_ok": bool(pieces_ok),
            "changed": not _same(_tensors(_gpt(tp=1, seed=4)), _tensors(ours)),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_gpt_model_round_trips_through_distckpt_at_tp2_and_tp1(tmp_path):
    results = run_ranks(WORLD, _round_trip, str(tmp_path / "ckpt"), timeout=240)
    for r in results:
        assert r["kinds"] == [
            ".".join(("megatron", "core", "dist_checkpointing", "mapping", "ShardedObject")),
            ".".join(("megatron", "core", "dist_checkpointing", "mapping", "ShardedTensor")),
        ]
        # 2 embeddings + 12 stacked per-layer tensors + final layernorm (2) + output layer.
        assert (r["tensor_keys"], r["plain_keys"]) == (17, 17)
        # ... plus the 4 extra-state ShardedObjects of each of the 2 layers.
        assert r["all_keys"] == 17 + 8
        assert r["tp2_equal"] and r["tp1_equal"] and r["pieces_ok"]
        assert r["same_result"], "distckpt.load returns what Megatron's load returns"
        assert r["changed"], "a freshly initialised model differs, so equality above means loaded"
    assert results[0]["leaves"] == results[1]["leaves"] == 37
    # Nothing sharded went to the common state.
    common = distckpt.load_common_state_dict(tmp_path / "ckpt")
    assert not common
