"""Adam for the example model in two flavours, both checkpointed with distckpt.

* :class:`Adam` -- Adam over this rank's parameters. Its state tensors have the
  shape of their parameters, so they are sharded exactly like them
  (:func:`distckpt.optimizer.optim_state_to_sharding_state`).
* :class:`DistributedAdam` -- the distributed optimizer (ZeRO-1): the rank's parameters are
  laid end to end in one flat buffer, cut into equal contiguous pieces over the data-parallel
  (DP) group, and each DP rank keeps Adam state for its piece only. A parameter's state is then
  a contiguous flat slice of the flattened tensor-parallel chunk
  (:func:`distckpt.optimizer.make_sharded_optimizer_tensor_flat`), and a checkpoint written
  under one DP x TP split loads under any other, or into :class:`Adam`.

Both store ``optimizer.state.exp_avg.<param key>`` and ``optimizer.state.exp_avg_sq.<param
key>``, ``param_groups`` as common state and the step count as the common ``step`` (torch keeps
one ``step`` per parameter; they are all equal here), so their checkpoints are interchangeable.

Gradients are summed over the DP group in one flat all-reduce before every step; the training
loop divides the loss by the *global* number of tokens, so the sum is the global mean's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distckpt.examples.parallel import ParallelState, all_gather_cat, all_reduce
from distckpt.mapping import ShardedStateDict, StateDict
from distckpt.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor_flat,
    optim_state_to_sharding_state,
)

STATE_NAMES = ("exp_avg", "exp_avg_sq")


def _flat_grads(params: list[nn.Parameter], padded_numel: int) -> torch.Tensor:
    flat = torch.zeros(padded_numel)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            flat[offset : offset + n] = p.grad.reshape(-1)
        offset += n
    return flat


class AdamKernel:
    """Adam over a list of tensors with ``torch.optim.Adam``'s arithmetic and ``state_dict`` format.

    The update is torch's default single-tensor Adam (no weight decay, no amsgrad), op for op, so
    the results are the same bits (tests/test_example_model.py checks it); ``state_dict()`` has
    torch's layout (``state`` keyed by position, ``param_groups`` with ``params`` positions), which
    is what :mod:`distckpt.optimizer` works on. torch.optim.Adam itself is not used because its
    first construction in a process imports ``torch._dynamo`` (about 2.5 s of CPU), which would
    dominate every rank that this CPU example and ``distckpt demo`` spawn.
    """

    def __init__(self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float):
        self.params = list(params)
        self.param_groups = [{"params": self.params, "lr": lr, "betas": tuple(betas), "eps": eps}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def init_state(self) -> None:
        """Create zero state for every tensor that has none (torch creates it at the first step)."""
        for p in self.params:
            if p not in self.state:
                self.state[p] = {
                    "step": torch.tensor(0.0),
                    **{
                        name: torch.zeros_like(p, memory_format=torch.preserve_format) for name in STATE_NAMES
                    },
                }

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        self.init_state()
        for p in self.params:
            if p.grad is None:
                continue
            state = self.state[p]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            step = state["step"].item()
            step_size = lr / (1 - beta1**step)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> StateDict:
        """``{"state": {position: {name: tensor}}, "param_groups": [...]}``; the tensors are shared."""
        positions = {id(p): i for i, p in enumerate(self.params)}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [positions[id(p)] for p in g["params"]],
            }
            for g in self.param_groups
        ]
        return {"state": {positions[id(p)]: st for p, st in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Take hyperparameters and copies of the state tensors from ``state_dict``."""
        for group, loaded in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in loaded.items() if k != "params"})
        self.state = {}
        for i, loaded in state_dict["state"].items():
            p = self.params[i]
            # As torch does: the step count keeps its dtype, moments take the parameter's.
            self.state[p] = {
                name: t.detach().clone() if name == "step" else t.detach().to(p.dtype, copy=True)
                for name, t in loaded.items()
            }


def _step_count(optimizer: AdamKernel) -> int:
    steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"parameters are at different Adam steps {sorted(steps)}")
    return steps.pop() if steps else 0


def _torch_state(state_dict: StateDict, id_map: dict[Any, int]) -> StateDict:
    """An AdamKernel state dict from a loaded one (``id_map``: loaded id -> kernel position)."""
    step = torch.tensor(float(state_dict["step"]))
    state = {}
    for loaded_id, torch_id in id_map.items():
        loaded = state_dict["state"][loaded_id]
        state[torch_id] = {"step": step.clone(), **{name: loaded[name] for name in STATE_NAMES}}
    return {"state": state, "param_groups": state_dict["param_groups"]}


class Adam:
    """Adam over the rank's parameters, after a DP all-reduce of the gradients."""

    def __init__(
        self,
        model: nn.Module,
        ps: ParallelState,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        self.ps = ps
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer = AdamKernel(self.params, lr, betas, eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def reduce_gradients(self) -> None:
        """All-reduce every gradient over DP, in one flat buffer that the gradients then view."""
        flat = all_reduce(_flat_grads(self.params, self.numel), self.ps.dp_group)
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def step(self) -> None:
        self.reduce_gradients()
        self.optimizer.step()

    def init_state(self) -> None:
        """Create zero state (Adam creates it at the first step) so a checkpoint can be loaded into it."""
        self.optimizer.init_state()

    def reload_model_params(self) -> None:
        """Nothing to do: this optimizer updates the model's parameters themselves."""

    def sharded_state_dict(self, model_sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
        """The optimizer state, each tensor sharded like its parameter in ``model_sharded_state_dict``."""
        state = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["step"] = _step_count(self.optimizer)
        return state

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load what ``distckpt.load(self.sharded_state_dict(...))`` returned."""
        self.optimizer.load_state_dict(_torch_state(state_dict, {i: i for i in state_dict["state"]}))


class DistributedAdam:
    """Adam whose state is split over the DP group in contiguous flat pieces (ZeRO-1).

    The flat buffer holds the rank's parameters in ``model.parameters()`` order, padded to a
    multiple of DP; DP rank ``d`` owns elements ``[d * n, (d + 1) * n)``. For each parameter that
    meets that range the rank keeps an fp32 main copy of its slice, on which Adam steps; the
    updated slices are then all-gathered into every DP rank's parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        ps: ParallelState,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        self.ps = ps
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // ps.dp)
        lo = ps.dp_rank * self.shard_numel
        hi = min(lo + self.shard_numel, self.numel)
        # (param index, start, stop): elements [start, stop) of the flattened param are ours.
        self.ranges: list[tuple[int, int, int]] = []
        self.main_params: list[nn.Parameter] = []
        offset = 0
        for i, p in enumerate(self.params):
            start, stop = max(offset, lo) - offset, min(offset + p.numel(), hi) - offset
            if start < stop:
                self.ranges.append((i, start, stop))
                self.main_params.append(nn.Parameter(p.detach().reshape(-1)[start:stop].clone()))
            offset += p.numel()
        if not self.main_params:
            raise ValueError(
                f"DP rank {ps.dp_rank} of {ps.dp} owns no element of the {self.numel} parameters; "
                "use fewer data-parallel ranks for a model this small"
            )
        self.optimizer = AdamKernel(self.main_params, lr, betas, eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        # Megatron reduce-scatters; an all-reduce of the whole buffer gives each rank the same
        # summed slice and needs nothing that gloo may lack.
        flat = all_reduce(_flat_grads(self.params, self.shard_numel * self.ps.dp), self.ps.dp_group)
        offsets = self._param_offsets()
        for (i, start, stop), main in zip(self.ranges, self.main_params):
            main.grad = flat[offsets[i] + start : offsets[i] + stop].clone()
        self.optimizer.step()
        self._gather_params()

    def _param_offsets(self) -> list[int]:
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += p.numel()
        return offsets

    def _gather_params(self) -> None:
        shard = torch.zeros(self.shard_numel)
        torch.cat(
            [m.detach() for m in self.main_params], out=shard[: sum(m.numel() for m in self.main_params)]
        )
        full = all_gather_cat(shard, self.ps.dp_group, self.ps.dp, dim=0)
        with torch.no_grad():
            for p, offset in zip(self.params, self._param_offsets()):
                p.copy_(full[offset : offset + p.numel()].view_as(p))

    def init_state(self) -> None:
        """Create zero state so that a checkpoint can be loaded into it."""
        self.optimizer.init_state()

    def reload_model_params(self) -> None:
        """Copy the model's (freshly loaded) parameters into the main slices."""
        with torch.no_grad():
            for (i, start, stop), main in zip(self.ranges, self.main_params):
                main.copy_(self.params[i].detach().reshape(-1)[start:stop])

    def sharded_state_dict(self, model_sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
        """Each state slice as a flat piece of its parameter's global tensor.

        The parameter's replica id ``(0, tp part, dp part)`` loses its DP part: every DP rank
        holds a different slice, so each is a main replica of what it holds.
        """
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        inner = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for j, (i, start, stop) in enumerate(self.ranges):
            if j not in inner["state"]:
                continue  # no step taken and no init_state(): nothing to save yet
            model_param = id_map[i]
            replica = tuple(model_param.replica_id[:-1]) + (0,)
            state[i] = {
                name: make_sharded_optimizer_tensor_flat(
                    model_param,
                    inner["state"][j][name],
                    slice(start, stop),
                    prefix=f"optimizer.state.{name}",
                    replica_id=replica,
                )
                for name in STATE_NAMES
            }
        # The inner optimizer's param_groups, with the process-local "params" made non-persistent.
        groups = {"state": {}, "param_groups": inner["param_groups"]}
        optim_state_to_sharding_state(groups, {})
        return {"state": state, "param_groups": groups["param_groups"], "step": _step_count(self.optimizer)}

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load what ``distckpt.load(self.sharded_state_dict(...))`` returned."""
        id_map = {i: j for j, (i, _, _) in enumerate(self.ranges)}
        self.optimizer.load_state_dict(_torch_state(state_dict, id_map))
