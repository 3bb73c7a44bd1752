"""What a PyTorch DCP user checkpoints, for the tests of ``distckpt.dcp``: an FSDP2 model and its
AdamW state behind a ``Stateful`` (torchtitan's shape), DTensor state dicts on a CPU mesh, a
planner that fails on chosen ranks, and a value whose unpickling leaves a trace.

Everything runs on the rank pool's gloo groups (``tests/support/harness.py``); FSDP2
(``torch.distributed.fsdp.fully_shard``) works on a CPU device mesh over gloo.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, Iterable

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful

IN, HIDDEN, OUT = 8, 24, 6


def mesh():
    """A 1-D CPU device mesh over every rank of the default (gloo) group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (tdist.get_world_size(),))


def fsdp2_model(seed: int = 0) -> torch.nn.Module:
    """A small MLP with each layer and the whole model sharded by FSDP2 over every rank."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    device_mesh = mesh()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    """``steps`` AdamW steps on the same batches on every rank."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randn(4, IN, generator=generator)
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        optimizer.step()


class AppState(Stateful):
    """Model and optimizer through DCP's ``get_state_dict``/``set_state_dict`` and a step count,
    as torchtitan's trainers hand them to ``dcp.save``/``dcp.load``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step = state_dict["step"]


def full_state(app: AppState) -> Dict[str, Any]:
    """Every tensor of the app's state whole (``DTensor.full_tensor``: a collective), by DCP's
    flattened name, and the non-tensor values; equal on every rank."""
    from torch.distributed.tensor import DTensor

    flat: Dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value.full_tensor() if isinstance(value, DTensor) else value

    walk("", app.state_dict())
    return dict(sorted(flat.items()))


def distribute_rows(tensor: torch.Tensor):
    """``tensor`` as a DTensor sharded by rows (``Shard(0)``) over every rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(tensor, mesh(), [Shard(0)])


class FaultyPlanner(DefaultSavePlanner):
    """DCP's default planner, except that resolving an item fails on ``ranks`` (DCP's own tests
    inject faults the same way): a user's failure in the middle of a save."""

    def __init__(self, ranks: Iterable[int]):
        super().__init__()
        self.ranks = set(ranks)

    def resolve_data(self, write_item):
        if tdist.get_rank() in self.ranks:
            raise OSError(f"injected failure resolving {write_item.index.fqn!r}")
        return super().resolve_data(write_item)


def touch(path: str) -> str:
    """Creates ``path``: what unpickling a :class:`Trace` runs."""
    Path(path).touch()
    return path


class Trace:
    """A value whose unpickling runs :func:`touch` (a stand-in for arbitrary code in a pickle)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (touch, (self.path,))


def quiet(fn, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` without DCP's "no process group: single process" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def save_big(path: str) -> None:
    """A save of 128 MiB (32 items of 4 MiB, files fsynced) through ``distckpt.dcp`` in one
    process: long enough for a parent to SIGKILL it while its data files are being written."""
    import torch.distributed.checkpoint as dcp

    import distckpt.dcp

    state = {f"layer{i}": torch.full((1024, 1024), float(i)) for i in range(32)}
    quiet(dcp.save, state, storage_writer=distckpt.dcp.StorageWriter(path, write_threads=1))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["save-big"]:
        save_big(sys.argv[2])
