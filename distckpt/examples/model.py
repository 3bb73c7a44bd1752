"""A small GPT split over tensor- and pipeline-parallel ranks, with ``sharded_state_dict()``.

Tensor parallelism (TP), the Megatron-Core way:

* ``VocabParallelEmbedding`` and the output layer split the vocabulary over TP ranks;
* ``ColumnParallelLinear`` splits its output features (attention QKV, MLP fc1): each rank
  computes a slice of the output from the whole input;
* ``RowParallelLinear`` splits its input features (attention projection, MLP fc2): each rank
  computes a partial sum, all-reduced over the TP group;
* layer norms, the position embedding and the row-parallel biases are replicated.

Pipeline parallelism (PP): stage ``s`` holds layers ``[s * L/PP, (s + 1) * L/PP)``, the first
stage also the embeddings, the last stage the final layer norm and the output layer.

Checkpointing: ``GPTModel.sharded_state_dict()`` returns ``{local state-dict name:
ShardedTensor or ShardedTensorFactory}`` whose leaves hold the parameters themselves; keys and
global shapes do not depend on the layout, so a checkpoint loads under any other TP x PP x DP:

* TP-split params: ``ShardedTensor.from_rank_offsets(key, p, (axis, tp_rank, tp))``;
* replicated params: one main replica (``replica_id`` all zeros) among TP and DP copies;
* per-layer params: one global tensor per kind of parameter with a prepended layer axis
  (``prepend_axis_num=1``, offset = global layer index), so PP can change too;
* SwiGLU fc1: a ``ShardedTensorFactory`` stores each rank's [w; v] halves at their places
  in the global [W; V], which keeps the checkpoint TP-reshardable.

Every parameter is initialised from its global tensor (seeded by its name), so the model starts
from the same weights under every layout.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distckpt import ShardedTensor, ShardedTensorFactory
from distckpt.examples.parallel import ParallelState, copy_to_tp, gather_from_tp, reduce_from_tp
from distckpt.mapping import ShardedStateDict
from distckpt.utils import replace_prefix_for_sharding

RankOffset = tuple[int, int, int]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model; the defaults make a model of about 11k parameters."""

    vocab_size: int = 32
    hidden_size: int = 16
    num_heads: int = 4
    ffn_hidden_size: int = 32
    num_layers: int = 4
    seq_length: int = 8
    init_std: float = 0.2
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def check_layout(self, tp: int, pp: int) -> None:
        """Raise ValueError if the model cannot be split ``tp`` x ``pp`` ways."""
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        for what, size in (
            ("num_heads", self.num_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
        ):
            if size % tp:
                raise ValueError(f"{what}={size} cannot be split over TP={tp}")
        if self.num_layers % pp:
            raise ValueError(f"num_layers={self.num_layers} cannot be split over PP={pp}")

    def init_tensor(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """The global initial value of parameter ``name`` (the same under every layout)."""
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ self.seed)
        return torch.randn(tuple(shape), generator=g) * self.init_std


# --------------------------------------------------------------------------- sharding helpers


def replica_id(ps: ParallelState, tp_replicated: bool) -> tuple[int, int, int]:
    """``(0, tp part, dp part)``: copies of a param on other TP/DP ranks are non-main replicas.

    The last entry counts data-parallel copies; a distributed optimizer, whose DP ranks hold
    different slices, zeroes it (see optimizers.DistributedAdam).
    """
    return (0, ps.tp_rank if tp_replicated else 0, ps.dp_rank)


def tp_sharded_tensor(
    param: torch.Tensor, key: str, axis: int, ps: ParallelState, prepend_offsets: Sequence[RankOffset] = ()
) -> ShardedTensor:
    """A param split over TP ranks along local ``axis``."""
    p = len(prepend_offsets)
    return ShardedTensor.from_rank_offsets(
        key,
        param,
        *prepend_offsets,
        (axis + p, ps.tp_rank, ps.tp),
        replica_id=replica_id(ps, tp_replicated=False),
        prepend_axis_num=p,
    )


def replicated_tensor(
    param: torch.Tensor, key: str, ps: ParallelState, prepend_offsets: Sequence[RankOffset] = ()
) -> ShardedTensor:
    """A param every TP rank holds whole (e.g. a layer norm)."""
    return ShardedTensor.from_rank_offsets(
        key,
        param,
        *prepend_offsets,
        replica_id=replica_id(ps, tp_replicated=True),
        prepend_axis_num=len(prepend_offsets),
    )


def swiglu_sharded_factory(
    param: torch.Tensor, key: str, ps: ParallelState, prepend_offsets: Sequence[RankOffset] = ()
) -> ShardedTensorFactory:
    """Save a TP rank's fused SwiGLU ``[w_r; v_r]`` as parts of the global ``[W; V]``.

    Locally the first half of axis 0 is this rank's slice of W and the second its slice of V.
    Saving the local tensor as one chunk would make the checkpoint's layout depend on TP (the
    global tensor would be [w_0; v_0; w_1; v_1; ...]); instead ``w_r`` is chunk ``r`` and
    ``v_r`` chunk ``tp + r`` of ``2 * tp`` chunks along axis 0, so the global tensor is
    ``[W; V]`` whatever TP is. With a ``flattened_range`` (a distributed optimizer's slice of
    the flattened local tensor) the slice is cut at the w/v boundary into two flat pieces.
    """
    p = len(prepend_offsets)
    tp, tp_rank = ps.tp, ps.tp_rank
    # Shape of w_r (and of v_r): half of the local tensor along axis 0.
    chunk_shape = (param.shape[0] // 2,) + tuple(param.shape[1:])
    boundary = math.prod(chunk_shape)

    def build(key: str, data: torch.Tensor, replica, flattened_range: slice | None) -> ShardedStateDict:
        if flattened_range is None:
            w, v = data[: chunk_shape[0]], data[chunk_shape[0] :]
            return {
                "w": ShardedTensor.from_rank_offsets(
                    key, w, *prepend_offsets, (p, tp_rank, 2 * tp), replica_id=replica, prepend_axis_num=p
                ),
                "v": ShardedTensor.from_rank_offsets(
                    key,
                    v,
                    *prepend_offsets,
                    (p, tp + tp_rank, 2 * tp),
                    replica_id=replica,
                    prepend_axis_num=p,
                ),
            }
        start, stop = flattened_range.start, flattened_range.stop
        parts = {}
        for name, lo, hi, index in (("w", 0, boundary, tp_rank), ("v", boundary, 2 * boundary, tp + tp_rank)):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                parts[name] = ShardedTensor.from_rank_offsets_flat(
                    key,
                    data[a - start : b - start],
                    chunk_shape,
                    *prepend_offsets,
                    (p, index, 2 * tp),
                    flattened_range=slice(a - lo, b - lo),
                    replica_id=replica,
                    prepend_axis_num=p,
                )
        return parts

    def merge(loaded: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([loaded[name] for name in ("w", "v") if name in loaded])

    return ShardedTensorFactory(key, param, build, merge, replica_id(ps, tp_replicated=False))


# --------------------------------------------------------------------------- layers


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output features (rows) split over TP ranks.

    ``swiglu=True``: the output is a fused [w; v] pair (each rank holds its rows of both).
    ``gather_output=True``: all-gather the output slices (the LM head, before the loss).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        ps: ParallelState,
        name: str,
        in_features: int,
        out_features: int,
        bias: bool = True,
        swiglu: bool = False,
        gather_output: bool = False,
    ):
        super().__init__()
        self.ps, self.swiglu, self.gather_output = ps, swiglu, gather_output
        self.weight = nn.Parameter(
            self._local(cfg.init_tensor(f"{name}.weight", (out_features, in_features)))
        )
        self.bias = (
            nn.Parameter(self._local(cfg.init_tensor(f"{name}.bias", (out_features,)))) if bias else None
        )

    def _local(self, full: torch.Tensor) -> torch.Tensor:
        tp, r = self.ps.tp, self.ps.tp_rank
        if not self.swiglu:
            return full.chunk(tp)[r].clone()
        w, v = full.chunk(2)
        return torch.cat([w.chunk(tp)[r], v.chunk(tp)[r]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.ps), self.weight, self.bias)
        return gather_from_tp(y, self.ps) if self.gather_output else y

    def sharded_state_dict(
        self, prefix: str, key: str, prepend_offsets: Sequence[RankOffset] = ()
    ) -> ShardedStateDict:
        out = {}
        for name, param in self.named_parameters():
            if self.swiglu:
                out[prefix + name] = swiglu_sharded_factory(param, key + name, self.ps, prepend_offsets)
            else:
                out[prefix + name] = tp_sharded_tensor(param, key + name, 0, self.ps, prepend_offsets)
        return out


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input features (columns) split over TP ranks; b replicated."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, name: str, in_features: int, out_features: int):
        super().__init__()
        self.ps = ps
        full = cfg.init_tensor(f"{name}.weight", (out_features, in_features))
        self.weight = nn.Parameter(full.chunk(ps.tp, dim=1)[ps.tp_rank].clone())
        self.bias = nn.Parameter(cfg.init_tensor(f"{name}.bias", (out_features,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the partial sums are reduced.
        return reduce_from_tp(F.linear(x, self.weight), self.ps) + self.bias

    def sharded_state_dict(
        self, prefix: str, key: str, prepend_offsets: Sequence[RankOffset] = ()
    ) -> ShardedStateDict:
        return {
            prefix + "weight": tp_sharded_tensor(self.weight, key + "weight", 1, self.ps, prepend_offsets),
            prefix + "bias": replicated_tensor(self.bias, key + "bias", self.ps, prepend_offsets),
        }


class LayerNorm(nn.LayerNorm):
    """A layer norm replicated on every TP rank (its inputs and gradients are identical there)."""

    def __init__(self, hidden_size: int, ps: ParallelState):
        super().__init__(hidden_size)
        self.ps = ps

    def sharded_state_dict(
        self, prefix: str, key: str, prepend_offsets: Sequence[RankOffset] = ()
    ) -> ShardedStateDict:
        return {
            prefix + name: replicated_tensor(p, key + name, self.ps, prepend_offsets)
            for name, p in self.named_parameters()
        }


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over TP ranks; lookups are all-reduced."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, name: str):
        super().__init__()
        self.ps = ps
        self.rows = cfg.vocab_size // ps.tp
        full = cfg.init_tensor(f"{name}.weight", (cfg.vocab_size, cfg.hidden_size))
        self.weight = nn.Parameter(full.chunk(ps.tp)[ps.tp_rank].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first = self.ps.tp_rank * self.rows
        outside = (ids < first) | (ids >= first + self.rows)
        local = torch.where(outside, torch.zeros_like(ids), ids - first)
        out = F.embedding(local, self.weight) * (~outside).unsqueeze(-1)
        return reduce_from_tp(out, self.ps)

    def sharded_state_dict(self, prefix: str, key: str) -> ShardedStateDict:
        return {prefix + "weight": tp_sharded_tensor(self.weight, key + "weight", 0, self.ps)}


class SelfAttention(nn.Module):
    """Causal multi-head attention; each TP rank owns ``num_heads / tp`` heads.

    QKV rows are ordered head by head (``[q_h, k_h, v_h]`` for every head h), so a TP split of
    the rows is a split of the heads, and the projection's input columns follow the same heads.
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, name: str):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads // ps.tp, cfg.head_dim
        h = cfg.hidden_size
        self.linear_qkv = ColumnParallelLinear(cfg, ps, f"{name}.linear_qkv", h, 3 * h)
        self.linear_proj = RowParallelLinear(cfg, ps, f"{name}.linear_proj", h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.linear_proj(out)

    def sharded_state_dict(
        self, prefix: str, key: str, prepend_offsets: Sequence[RankOffset] = ()
    ) -> ShardedStateDict:
        out = self.linear_qkv.sharded_state_dict(prefix + "linear_qkv.", key + "linear_qkv.", prepend_offsets)
        out.update(
            self.linear_proj.sharded_state_dict(
                prefix + "linear_proj.", key + "linear_proj.", prepend_offsets
            )
        )
        return out


class SwiGLUMLP(nn.Module):
    """``fc2(silu(x W^T) * (x V^T))`` with the fused fc1 ``[W; V]`` column-parallel."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, name: str):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(cfg, ps, f"{name}.linear_fc1", h, 2 * f, swiglu=True)
        self.linear_fc2 = RowParallelLinear(cfg, ps, f"{name}.linear_fc2", f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, v = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(w) * v)

    def sharded_state_dict(
        self, prefix: str, key: str, prepend_offsets: Sequence[RankOffset] = ()
    ) -> ShardedStateDict:
        out = self.linear_fc1.sharded_state_dict(prefix + "linear_fc1.", key + "linear_fc1.", prepend_offsets)
        out.update(
            self.linear_fc2.sharded_state_dict(prefix + "linear_fc2.", key + "linear_fc2.", prepend_offsets)
        )
        return out


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, global_index: int):
        super().__init__()
        name = f"decoder.layers.{global_index}"
        self.input_layernorm = LayerNorm(cfg.hidden_size, ps)
        self.self_attention = SelfAttention(cfg, ps, f"{name}.self_attention")
        self.pre_mlp_layernorm = LayerNorm(cfg.hidden_size, ps)
        self.mlp = SwiGLUMLP(cfg, ps, f"{name}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))

    def sharded_state_dict(self, prefix: str, prepend_offsets: Sequence[RankOffset]) -> ShardedStateDict:
        """Keys are ``prefix + name`` for now; the block renames them to the stacked keys."""
        out = {}
        for name, child in self.named_children():
            out.update(child.sharded_state_dict(f"{prefix}{name}.", f"{prefix}{name}.", prepend_offsets))
        return out


class TransformerBlock(nn.Module):
    """This pipeline stage's layers (and, on the last stage, the final layer norm)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        per_stage = cfg.num_layers // ps.pp
        self.num_layers, self.offset = cfg.num_layers, ps.pp_rank * per_stage
        self.layers = nn.ModuleList(TransformerLayer(cfg, ps, self.offset + i) for i in range(per_stage))
        self.final_layernorm = LayerNorm(cfg.hidden_size, ps) if ps.is_last_stage else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.final_layernorm is None else self.final_layernorm(x)

    def sharded_state_dict(self, prefix: str) -> ShardedStateDict:
        out: ShardedStateDict = {}
        for i, layer in enumerate(self.layers):
            # Layer i of this stage is layer offset + i of the model: one global tensor per kind
            # of parameter, with the layer number as a prepended axis.
            layer_prefix = f"{prefix}layers.{i}."
            sd = layer.sharded_state_dict(layer_prefix, ((0, self.offset + i, self.num_layers),))
            replace_prefix_for_sharding(sd, layer_prefix, f"{prefix}layers.")
            out.update(sd)
        if self.final_layernorm is not None:
            out.update(
                self.final_layernorm.sharded_state_dict(
                    f"{prefix}final_layernorm.", f"{prefix}final_layernorm."
                )
            )
        return out


class Embedding(nn.Module):
    """Word (vocab-parallel) plus learned position (replicated) embeddings."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.word_embeddings = VocabParallelEmbedding(cfg, ps, "embedding.word_embeddings")
        self.position_embeddings = nn.Parameter(
            cfg.init_tensor("embedding.position_embeddings.weight", (cfg.seq_length, cfg.hidden_size))
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(ids) + self.position_embeddings[: ids.shape[1]]

    def sharded_state_dict(self, prefix: str) -> ShardedStateDict:
        out = self.word_embeddings.sharded_state_dict(
            f"{prefix}word_embeddings.", f"{prefix}word_embeddings."
        )
        out[f"{prefix}position_embeddings"] = replicated_tensor(
            self.position_embeddings, f"{prefix}position_embeddings.weight", self.ps
        )
        return out


class GPTModel(nn.Module):
    """One pipeline stage of the GPT, tensor-parallel inside.

    ``forward`` takes token ids on the first stage and the previous stage's hidden states on the
    others; it returns the hidden states, or the full-vocabulary logits on the last stage.
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        cfg.check_layout(ps.tp, ps.pp)
        self.cfg, self.ps = cfg, ps
        self.embedding = Embedding(cfg, ps) if ps.is_first_stage else None
        self.decoder = TransformerBlock(cfg, ps)
        self.output_layer = None
        if ps.is_last_stage:
            self.output_layer = ColumnParallelLinear(
                cfg, ps, "output_layer", cfg.hidden_size, cfg.vocab_size, bias=False, gather_output=True
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        x = self.decoder(x)
        return x if self.output_layer is None else self.output_layer(x)

    def sharded_state_dict(self, prefix: str = "") -> ShardedStateDict:
        """``{state-dict name: sharded leaf}`` over this rank's parameters (the params themselves).

        Load with ``model.load_state_dict(distckpt.load(model.sharded_state_dict(), ckpt))``.
        """
        out: ShardedStateDict = {}
        if self.embedding is not None:
            out.update(self.embedding.sharded_state_dict(f"{prefix}embedding."))
        out.update(self.decoder.sharded_state_dict(f"{prefix}decoder."))
        if self.output_layer is not None:
            out.update(
                self.output_layer.sharded_state_dict(f"{prefix}output_layer.", f"{prefix}output_layer.")
            )
        return out
