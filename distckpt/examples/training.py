"""Training loop of the example GPT: data, the pipelined step, and checkpoints with distckpt.

``run`` is what every rank executes: build the model at a layout, optionally resume from a
checkpoint (saved under any layout), train, optionally save. Data and initial weights depend on
the iteration and the parameter names only, never on the layout, so an interrupted run resumed
under another layout is comparable to an uninterrupted one.

A checkpoint holds::

    {"model": GPTModel.sharded_state_dict(),             # sharded
     "optimizer": optimizer.sharded_state_dict(model_sd), # sharded (+ param_groups, step: common)
     "iteration": int, "config": {...}, "layout": "TP2xPP2xDP2"}   # common

``run_with_recovery`` trains with two checkpoint tiers, as a long job would: the local tier
(:class:`distckpt.local.LocalCheckpointManager`, node-local and replicated to peers) every few
iterations, a persistent checkpoint every many; on start it resumes from whichever is newer.
``run_tiered`` saves tiered checkpoints instead (:mod:`distckpt.tiered`: node-local first, then
uploaded to a remote store in the background) and resumes from the nearest intact copy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import distckpt
from distckpt.dict_utils import dict_list_map_inplace
from distckpt.examples.model import GPTConfig, GPTModel
from distckpt.examples.optimizers import Adam, DistributedAdam
from distckpt.examples.parallel import (
    Layout,
    ParallelState,
    all_reduce,
    recv_from_stage,
    send_to_stage,
)
from distckpt.local import LocalCheckpointManager
from distckpt.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.tiered import TieredCheckpointManager

Optimizer = Adam | DistributedAdam

LOSS_RTOL = 1e-5
"""Relative tolerance for losses of runs under different layouts.

Changing TP or DP changes the order of floating-point sums (partial matmul sums all-reduced over
TP, gradients summed over DP), so the same step differs by a few float32 ulps (~1e-7 relative)
per step; Adam carries that forward. Under the same layout, resuming is bitwise exact.
"""


@dataclass(frozen=True)
class TrainConfig:
    """What ``run`` does besides the model sizes."""

    global_batch_size: int = 8
    lr: float = 1e-2
    distributed_optimizer: bool = False
    model: GPTConfig = field(default_factory=GPTConfig)


@dataclass
class RunResult:
    """What one rank reports: the losses (on last-stage ranks; None elsewhere) and the state."""

    rank: int
    first_iteration: int
    losses: list[float] | None
    resumed_from: str | None = None


def batch(cfg: GPTConfig, iteration: int, global_batch_size: int) -> torch.Tensor:
    """Token ids ``[global_batch_size, seq_length + 1]`` of ``iteration``, layout-independent.

    Each sequence counts up modulo the vocabulary from a random start with a random stride, so
    the model has something to learn.
    """
    g = torch.Generator().manual_seed(cfg.seed * 7919 + iteration)
    start = torch.randint(0, cfg.vocab_size, (global_batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (global_batch_size, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq_length + 1)) % cfg.vocab_size


def build(layout: Layout, train_cfg: TrainConfig) -> tuple[ParallelState, GPTModel, Optimizer]:
    """This rank's parallel state, model stage and optimizer."""
    if train_cfg.global_batch_size % layout.dp:
        raise ValueError(f"global batch {train_cfg.global_batch_size} cannot be split over DP={layout.dp}")
    ps = ParallelState.initialize(layout)
    model = GPTModel(train_cfg.model, ps)
    optimizer_cls = DistributedAdam if train_cfg.distributed_optimizer else Adam
    return ps, model, optimizer_cls(model, ps, lr=train_cfg.lr)


def train_step(
    model: GPTModel, optimizer: Optimizer, ps: ParallelState, tokens: torch.Tensor
) -> float | None:
    """One step on the global batch ``tokens``; returns the mean loss on last-stage ranks.

    Pipeline: every stage but the first receives its input activations from the previous stage
    and every stage but the last sends its output on; the gradients flow back the same way.
    """
    cfg = model.cfg
    rows = tokens.shape[0] // ps.dp
    local = tokens[ps.dp_rank * rows : (ps.dp_rank + 1) * rows]
    inputs, labels = local[:, :-1], local[:, 1:]
    optimizer.zero_grad()

    if ps.is_first_stage:
        x = inputs
    else:
        x = recv_from_stage((rows, cfg.seq_length, cfg.hidden_size), ps, -1).requires_grad_()
    out = model(x)
    loss = None
    if ps.is_last_stage:
        # Normalised by the global token count: summing gradients over DP gives the global mean's.
        loss = F.cross_entropy(out.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="sum")
        loss = loss / tokens[:, 1:].numel()
        loss.backward()
    else:
        send_to_stage(out, ps, +1)
        out.backward(recv_from_stage(out.shape, ps, +1))
    if not ps.is_first_stage:
        send_to_stage(x.grad, ps, -1)
    optimizer.step()

    if loss is None:
        return None
    return float(all_reduce(loss.detach().clone(), ps.dp_group))


def checkpoint_sharded_state_dict(model: GPTModel, optimizer: Optimizer, iteration: int) -> ShardedStateDict:
    """The whole training state as one sharded state dict (see the module docstring)."""
    model_sd = model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd),
        "iteration": iteration,
        "config": asdict(model.cfg),
        "layout": str(model.ps.layout),
    }


def save_checkpoint(
    ckpt_dir: str | Path,
    model: GPTModel,
    optimizer: Optimizer,
    iteration: int,
    extra: ShardedStateDict | None = None,
) -> None:
    """Save the training state (plus ``extra`` entries, e.g. RNG states); every rank calls it."""
    state = checkpoint_sharded_state_dict(model, optimizer, iteration)
    state.update(extra or {})
    distckpt.save(state, ckpt_dir)


def _detached(leaf):
    if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and isinstance(leaf.data, torch.Tensor):
        leaf.data = leaf.data.detach()
    return leaf


def load_checkpoint(
    ckpt_dir: str | Path, model: GPTModel, optimizer: Optimizer, extra: ShardedStateDict | None = None
) -> StateDict:
    """Restore model and optimizer from a checkpoint saved under any layout; every rank calls it.

    Returns the loaded state dict: ``iteration``, the ``layout`` it was saved under, and the
    entries that ``extra`` asked for.
    """
    return _restore(lambda request: distckpt.load(request, ckpt_dir), model, optimizer, extra)


def load_local_checkpoint(
    manager: LocalCheckpointManager, model: GPTModel, optimizer: Optimizer, iteration: int | None = None
) -> StateDict:
    """Restore model and optimizer from the local tier (same layout as saved); every rank calls it."""
    return _restore(lambda request: manager.load(request, iteration), model, optimizer, None)


def _restore(
    load: Callable[[ShardedStateDict], StateDict],
    model: GPTModel,
    optimizer: Optimizer,
    extra: ShardedStateDict | None,
) -> StateDict:
    optimizer.init_state()
    request = checkpoint_sharded_state_dict(model, optimizer, iteration=-1)
    request.update(extra or {})
    # The request's leaves hold the parameters themselves (that is how the optimizer state found
    # its parameters); distckpt fills them in place, which autograd forbids on a leaf that
    # requires grad, so it gets detached views of the same storage.
    dict_list_map_inplace(_detached, request)
    state = load(request)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    optimizer.reload_model_params()
    return state


def run(
    layout: Layout | str,
    steps: int,
    train_cfg: TrainConfig = TrainConfig(),
    load_dir: str | None = None,
    save_dir: str | None = None,
    save_at: int | None = None,
) -> RunResult:
    """Every rank: build at ``layout``, resume from ``load_dir`` if given, train ``steps`` steps.

    With ``save_dir``, the state is saved after ``save_at`` of those steps (default: after the
    last), and training goes on: the losses after ``save_at`` are those of an uninterrupted run.
    """
    layout = Layout.parse(layout) if isinstance(layout, str) else layout
    ps, model, optimizer = build(layout, train_cfg)
    iteration, resumed_from = 0, None
    if load_dir is not None:
        state = load_checkpoint(load_dir, model, optimizer)
        iteration, resumed_from = state["iteration"], state["layout"]
    first = iteration
    save_at = steps if save_at is None else save_at
    losses: list[float | None] = []
    for step in range(steps + 1):
        if save_dir is not None and step == save_at:
            save_checkpoint(save_dir, model, optimizer, iteration)
        if step == steps:
            break
        tokens = batch(train_cfg.model, iteration, train_cfg.global_batch_size)
        losses.append(train_step(model, optimizer, ps, tokens))
        iteration += 1
    return RunResult(ps.rank, first, losses if ps.is_last_stage else None, resumed_from)


@dataclass(frozen=True)
class CheckpointPlan:
    """Two checkpoint tiers (see docs/local-recovery.md).

    ``local_root/node<rank // node_size>`` is each rank's node-local directory; the local tier
    saves every ``local_every`` iterations. Persistent checkpoints go to
    ``persistent_dir/iter_<NNNNNNN>`` every ``persistent_every`` iterations. 0 turns a tier off.
    """

    local_root: str | None = None
    local_every: int = 0
    persistent_dir: str | None = None
    persistent_every: int = 0
    node_size: int = 1
    replication_factor: int = 2

    def manager(self, rank: int) -> LocalCheckpointManager | None:
        if self.local_root is None:
            return None
        return LocalCheckpointManager(
            Path(self.local_root) / f"node{rank // self.node_size}",
            node_size=self.node_size,
            replication_factor=self.replication_factor,
        )

    def latest_persistent(self) -> int | None:
        """Newest committed persistent checkpoint (shared storage: the same on every rank)."""
        if self.persistent_dir is None or not Path(self.persistent_dir).is_dir():
            return None
        found = [
            int(m.group(1))
            for p in Path(self.persistent_dir).iterdir()
            if (m := re.fullmatch(r"iter_(\d{7})", p.name)) and distckpt.check_is_distributed_checkpoint(p)
        ]
        return max(found, default=None)

    def persistent_path(self, iteration: int) -> Path:
        return Path(self.persistent_dir) / f"iter_{iteration:07d}"


def run_with_recovery(
    layout: Layout | str, until: int, train_cfg: TrainConfig, plan: CheckpointPlan, stop_at: int | None = None
) -> RunResult:
    """Every rank: resume from the newer of the local tier and the persistent checkpoints (if
    any), then train up to iteration ``until`` saving as ``plan`` says; ``stop_at`` ends the
    run early, as a crash would. ``resumed_from`` is ``"local"``, ``"persistent"`` or None.
    """
    layout = Layout.parse(layout) if isinstance(layout, str) else layout
    ps, model, optimizer = build(layout, train_cfg)
    manager = plan.manager(ps.rank)
    local = manager.find_latest() if manager is not None else None
    persistent = plan.latest_persistent()
    iteration, resumed_from = 0, None
    if local is not None and (persistent is None or local >= persistent):
        iteration, resumed_from = (
            load_local_checkpoint(manager, model, optimizer, local)["iteration"],
            "local",
        )
    elif persistent is not None:
        iteration = load_checkpoint(plan.persistent_path(persistent), model, optimizer)["iteration"]
        resumed_from = "persistent"
    first = iteration
    losses: list[float | None] = []
    end = until if stop_at is None else min(until, stop_at)
    while iteration < end:
        tokens = batch(train_cfg.model, iteration, train_cfg.global_batch_size)
        losses.append(train_step(model, optimizer, ps, tokens))
        iteration += 1
        if manager is not None and plan.local_every and iteration % plan.local_every == 0:
            manager.save(checkpoint_sharded_state_dict(model, optimizer, iteration), iteration)
        if (
            plan.persistent_dir is not None
            and plan.persistent_every
            and iteration % plan.persistent_every == 0
        ):
            save_checkpoint(plan.persistent_path(iteration), model, optimizer, iteration)
    return RunResult(ps.rank, first, losses if ps.is_last_stage else None, resumed_from)


@dataclass(frozen=True)
class TieredPlan:
    """Tiered checkpoints (see docs/tiered.md): every ``every`` iterations to each node's
    ``local_root/node<rank // node_size>`` first, uploaded to ``remote`` in the background."""

    remote: str
    local_root: str
    every: int
    node_size: int = 1
    keep_local: int = 2
    keep_remote: int | None = 3
    async_save: bool = False

    def manager(self, rank: int) -> TieredCheckpointManager:
        return TieredCheckpointManager(
            self.remote,
            Path(self.local_root) / f"node{rank // self.node_size}",
            keep_local=self.keep_local,
            keep_remote=self.keep_remote,
            node_size=self.node_size,
        )


def run_tiered(
    layout: Layout | str, until: int, train_cfg: TrainConfig, plan: TieredPlan, stop_at: int | None = None
) -> RunResult:
    """Every rank: resume from the newest tiered checkpoint (each file from this node's copy when
    it is intact, else from the remote; any layout), train up to ``until`` saving every
    ``plan.every`` iterations. ``stop_at`` ends the run early without waiting for the uploads,
    as a crash would. ``resumed_from`` says how many files came from each tier."""
    layout = Layout.parse(layout) if isinstance(layout, str) else layout
    ps, model, optimizer = build(layout, train_cfg)
    tiers = plan.manager(ps.rank)
    latest = tiers.find_latest()
    iteration, resumed_from = 0, None
    if latest is not None:
        iteration = _restore(lambda request: tiers.load(request, latest), model, optimizer, None)["iteration"]
        sources = list(tiers.last_load.files.values())
        resumed_from = f"{sources.count('local')} files local, {sources.count('remote')} remote"
    first = iteration
    losses: list[float | None] = []
    end = until if stop_at is None else min(until, stop_at)
    queue = AsyncCallsQueue() if plan.async_save else None
    while iteration < end:
        tokens = batch(train_cfg.model, iteration, train_cfg.global_batch_size)
        losses.append(train_step(model, optimizer, ps, tokens))
        iteration += 1
        if queue is not None:
            queue.maybe_finalize_async_calls()
        if iteration % plan.every == 0:
            state = checkpoint_sharded_state_dict(model, optimizer, iteration)
            if queue is not None:
                queue.schedule_async_request(tiers.save(state, iteration, async_sharded_save=True))
            else:
                tiers.save(state, iteration)
        tiers.finalize()
    if stop_at is None or stop_at >= until:
        if queue is not None:
            queue.close()
        tiers.close()
    return RunResult(ps.rank, first, losses if ps.is_last_stage else None, resumed_from)


def last_stage_losses(results: Sequence[RunResult]) -> list[float]:
    """The losses of a run: the last rank is always on the last pipeline stage."""
    return results[-1].losses


def losses_match(reference: Sequence[float], resumed: Sequence[float], rtol: float = LOSS_RTOL) -> bool:
    """Whether every resumed loss is within ``rtol`` (relative) of the reference loss."""
    return len(reference) == len(resumed) and all(
        math.isclose(a, b, rel_tol=rtol, abs_tol=0.0) for a, b in zip(reference, resumed)
    )
