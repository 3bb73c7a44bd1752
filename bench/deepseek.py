"""A DeepSeek-V3-like Mixture-of-Experts model as ``bench.scale`` simulates it, rank by rank.

61 layers of multi-head latent attention (hidden 7168) and a MoE MLP of 256 routed experts
(``moe_ffn`` 2048, gated: fc1 is ``2 x 2048``) plus one shared expert, with no tensor parallelism,
pipeline parallelism 16 and expert parallelism ``ep`` (8 or 64) carved out of data parallelism
(``DP = world / 16``, expert data parallelism ``EDP = DP / ep``). Every layer is a MoE layer, the
way Megatron-Core stacks homogeneous layers: each parameter is one key with the layer axis
prepended, and the routed experts' weights (``SequentialMLP``) prepend an expert axis too, so
``decoder.layers.mlp.experts.linear_fc1.weight`` has the global shape ``(61, 256, 4096, 7168)``
and 15,616 chunks. (DeepSeek-V3 itself has 3 dense layers first; Megatron-Core stores a model
with mixed layers under per-layer keys, a smaller grid: this is the harder case.)

The distributed optimizer keeps fp32 ``param``, ``exp_avg`` and ``exp_avg_sq`` of each parameter
as flattened slices, the way Megatron-Core's does: a pipeline stage's dense parameters, in
order, form one buffer cut evenly over its DP ranks, and its experts' parameters one buffer per
expert-parallel rank cut over its EDP ranks; a rank holds the part of each parameter that falls
in its cut (most parameters lie in one or two ranks' cuts, a few span many).

:func:`rank_shards` returns one rank's shard descriptions (what it sends for validation) and
write items (the main replicas it writes), as ``bench.scale``'s GPT-3 model does.
"""

from __future__ import annotations

import bisect
import math
from typing import Dict, List, Tuple

import torch

from distckpt.strategies.torch_dist.plan import WriteItem
from distckpt.strategies.torch_dist.records import KeyDecl

LAYERS, HIDDEN, EXPERTS, MOE_FFN, VOCAB, PP = 61, 7168, 256, 2048, 129280, 16
OPT_STATES = ("param", "exp_avg", "exp_avg_sq")

# Per layer: name, shape. Attention (MLA: query and key-value low-rank projections), the norms,
# the router, the shared expert: replicated over DP.
DENSE = [
    ("self_attention.linear_q_down_proj.weight", (1536, HIDDEN)),
    ("self_attention.linear_q_up_proj.weight", (128 * 192, 1536)),
    ("self_attention.linear_kv_down_proj.weight", (576, HIDDEN)),
    ("self_attention.linear_kv_up_proj.weight", (128 * 256, 512)),
    ("self_attention.linear_proj.weight", (HIDDEN, 128 * 128)),
    ("self_attention.q_layernorm.weight", (1536,)),
    ("self_attention.kv_layernorm.weight", (512,)),
    ("input_layernorm.weight", (HIDDEN,)),
    ("pre_mlp_layernorm.weight", (HIDDEN,)),
    ("mlp.router.weight", (EXPERTS, HIDDEN)),
    ("mlp.router.expert_bias", (EXPERTS,)),
    ("mlp.shared_experts.linear_fc1.weight", (2 * MOE_FFN, HIDDEN)),
    ("mlp.shared_experts.linear_fc2.weight", (HIDDEN, MOE_FFN)),
]
# Per routed expert (prepended: layer, expert).
ROUTED = [
    ("mlp.experts.linear_fc1.weight", (2 * MOE_FFN, HIDDEN)),
    ("mlp.experts.linear_fc2.weight", (HIDDEN, MOE_FFN)),
]


def layout(world: int, ep: int) -> Tuple[int, int, int]:
    """(PP, DP, EDP) of ``world`` ranks."""
    dp = world // PP
    if dp < ep or dp % ep:
        raise ValueError(f"{world} ranks: DP {dp} is not a multiple of EP {ep}")
    return PP, dp, dp // ep


def stage_layers(stage: int) -> range:
    return range(round(stage * LAYERS / PP), round((stage + 1) * LAYERS / PP))


class _Param:
    """One parameter piece of a rank: key, global shape, offset, local shape (prepended axes as 1s)."""

    __slots__ = ("key", "gshape", "offset", "local", "prepend")

    def __init__(self, key, gshape, offset, local, prepend):
        self.key, self.gshape, self.offset, self.local, self.prepend = key, gshape, offset, local, prepend

    @property
    def numel(self) -> int:
        return math.prod(self.local)

    def grid_index(self) -> Tuple[int, ...]:
        return tuple(o // max(1, s) for o, s in zip(self.offset, self.local))


def _dense_params(stage: int) -> List[_Param]:
    out = []
    if stage == 0:
        out.append(_Param("embedding.word_embeddings.weight", (VOCAB, HIDDEN), (0, 0), (VOCAB, HIDDEN), 0))
    for layer in stage_layers(stage):
        for name, shape in DENSE:
            out.append(
                _Param(
                    f"decoder.layers.{name}", (LAYERS,) + shape, (layer,) + (0,) * len(shape), (1,) + shape, 1
                )
            )
    if stage == PP - 1:
        out.append(_Param("decoder.final_layernorm.weight", (HIDDEN,), (0,), (HIDDEN,), 0))
        out.append(_Param("output_layer.weight", (VOCAB, HIDDEN), (0, 0), (VOCAB, HIDDEN), 0))
    return out


def _expert_params(stage: int, ep: int, ep_rank: int) -> List[_Param]:
    local = EXPERTS // ep
    out = []
    for layer in stage_layers(stage):
        for e in range(ep_rank * local, (ep_rank + 1) * local):
            for name, shape in ROUTED:
                out.append(
                    _Param(
                        f"decoder.layers.{name}",
                        (LAYERS, EXPERTS) + shape,
                        (layer, e) + (0,) * len(shape),
                        (1, 1) + shape,
                        2,
                    )
                )
    return out


class _Buffer:
    """Parameters laid end to end and cut evenly over ``parts`` ranks (a distributed optimizer's
    buffer): which part of which parameter each rank holds, found by bisection."""

    def __init__(self, params: List[_Param], parts: int):
        self.params = params
        self.starts = [0]
        for p in params:
            self.starts.append(self.starts[-1] + p.numel)
        self.cut = -(-self.starts[-1] // parts)

    def pieces(self, part: int) -> List[Tuple[_Param, int, int]]:
        lo, hi = part * self.cut, min((part + 1) * self.cut, self.starts[-1])
        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.params) and self.starts[i] < hi:
            a, b = max(lo, self.starts[i]), min(hi, self.starts[i + 1])
            if b > a:
                out.append((self.params[i], a - self.starts[i], b - self.starts[i]))
            i += 1
        return out


_BUFFERS: Dict[Tuple, _Buffer] = {}


def _buffer(kind: str, stage: int, ep: int, ep_rank: int, parts: int) -> _Buffer:
    key = (kind, stage, ep, ep_rank, parts)
    if key not in _BUFFERS:
        params = _dense_params(stage) if kind == "dense" else _expert_params(stage, ep, ep_rank)
        _BUFFERS[key] = _Buffer(params, parts)
    return _BUFFERS[key]


def rank_shards(rank: int, world: int, ep: int):
    """The shard descriptions and write items of one simulated rank (see the module docstring)."""
    pp, dp, edp = layout(world, ep)
    stage = rank // dp
    dp_rank = rank % dp
    ep_rank, edp_rank = dp_rank % ep, dp_rank // ep
    metas, items = [], []
    groups = [
        ("dense", _buffer("dense", stage, ep, 0, dp), dp_rank, dp_rank == 0),
        ("experts", _buffer("experts", stage, ep, ep_rank, edp), edp_rank, edp_rank == 0),
    ]
    for _, buf, part, main in groups:
        for p in buf.params:
            metas.append((p.key, False, "torch.bfloat16", p.gshape, p.offset, p.local, None, main))
            if main:
                items.append(WriteItem(p.key, p.offset, p.local, None, 2 * p.numel))
        for p, start, stop in buf.pieces(part):
            grid = p.grid_index()
            for state in OPT_STATES:
                okey = f"optimizer.state.{state}.{p.key}"
                metas.append((okey, False, "torch.float32", p.gshape, p.offset, p.local, (start, stop), True))
                items.append(
                    WriteItem(
                        okey, grid + (start,), (1,) * len(grid) + (stop - start,), None, 4 * (stop - start)
                    )
                )
    return metas, items


def decls_of(world: int, ep: int) -> Dict[str, KeyDecl]:
    """What rank 0 declares for every key of ``.metadata``."""
    decls = {}
    params = {}
    for stage in range(PP):
        for p in _dense_params(stage) + _expert_params(stage, 1, 0):
            params.setdefault(p.key, p)
    for key, p in params.items():
        decls[key] = KeyDecl(False, torch.bfloat16, p.gshape)
        grid = tuple(g // max(1, s) for g, s in zip(p.gshape, p.local))
        for state in OPT_STATES:
            decls[f"optimizer.state.{state}.{key}"] = KeyDecl(
                False, torch.float32, grid + (math.prod(p.local),), p.gshape
            )
    return decls
