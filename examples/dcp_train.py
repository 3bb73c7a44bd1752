#!/usr/bin/env python3
"""A torchtitan-style training loop on PyTorch DCP that checkpoints through ``distckpt.dcp``,
is killed in the middle of an async save, and resumes.

    python examples/dcp_train.py                                   # checkpoints in a temp folder
    python examples/dcp_train.py --checkpoint s3://bucket/run7     # or gs://, az://, a path
    python examples/dcp_train.py --ranks 4 --steps 30 --every 5 --kill-at 22

The model is an MLP sharded by FSDP2 (``fully_shard`` on a CPU device mesh over gloo), trained
with AdamW; the app state (model and optimizer through ``get_state_dict``/``set_state_dict``, the
step, the data loader's position) is a ``Stateful``, as torchtitan hands it to DCP. The one line
that differs from a DCP user's code is the ``storage_writer=`` / ``storage_reader=`` argument.

Three runs on fresh gloo ranks:

1. reference: ``--steps`` steps, no checkpoints;
2. the job: the same, with ``dcp.async_save`` every ``--every`` steps to
   ``<checkpoint>/step_<N>`` (on a process group of its own, as torchtitan does: the save's
   collectives run in the background while training's run on the default group); every rank is
   SIGKILLed at step ``--kill-at``, right after it started an async save;
3. the restart: finds the newest committed checkpoint (``metadata.json`` present: the save cut
   by the kill never committed, and the one before it is whole), loads it with ``dcp.load`` and
   trains to the end.

Exit status 0 when the restart's losses equal the reference's from the resumed step on, bit for
bit (same layout, same data, deterministic CPU kernels), else 1. For an object store, the
credentials and endpoint come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
...), as for every distckpt location (docs/storage.md).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import distckpt
import distckpt.dcp
from distckpt import storage
from distckpt.examples.launch import LaunchError, launch

IN, HIDDEN, OUT, BATCH = 16, 64, 8, 8


class DataLoader(Stateful):
    """Batches drawn from a generator seeded by the step: its state is the position."""

    def __init__(self) -> None:
        self.position = 0

    def next(self):
        generator = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        x = torch.randn(BATCH, IN, generator=generator)
        return x, torch.tanh(x[:, :OUT])

    def state_dict(self) -> Dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.position = state_dict["position"]


class TrainState(Stateful):
    """Model and optimizer (DCP's distributed state dict API), the step and the data position."""

    def __init__(self, model, optimizer, data: DataLoader) -> None:
        self.model, self.optimizer, self.data, self.step = model, optimizer, data, 0

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "step": self.step, "data": self.data.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step = state_dict["step"]
        self.data.load_state_dict(state_dict["data"])


class Checkpointer:
    """What torchtitan's CheckpointManager does with DCP, with distckpt as the storage: one async
    save in flight at most, on a gloo group of its own; resume from the newest committed step."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.group = tdist.new_group(backend="gloo")
        self.future = None

    def path(self, step: int) -> str:
        return f"{self.root}/step_{step:06d}"

    def save(self, state: TrainState) -> None:
        self.wait()
        writer = distckpt.dcp.StorageWriter(self.path(state.step))
        self.future = dcp.async_save({"train": state}, storage_writer=writer, process_group=self.group)

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def latest(self) -> Optional[int]:
        """The newest step whose checkpoint is committed (the same answer on every rank)."""
        steps = [
            int(m.group(1))
            for name in storage.open_store(self.root).list()
            if (m := re.fullmatch(r"step_(\d+)/metadata\.json", name))
        ]
        return max(steps, default=None)

    def load(self, state: TrainState, step: int) -> None:
        dcp.load({"train": state}, storage_reader=distckpt.dcp.StorageReader(self.path(step)))


def train(root: Optional[str], steps: int, every: int, kill_at: Optional[int], resume: bool) -> List[float]:
    """One rank's job; returns the losses of the steps it trained, by step (None before)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, OUT),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, optimizer, DataLoader())
    checkpointer = Checkpointer(root) if root is not None else None
    if resume:
        step = checkpointer.latest()
        if step is not None:
            checkpointer.load(state, step)
    losses: List[Optional[float]] = [None] * (state.step + 1)
    while state.step < steps:
        x, y = state.data.next()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        state.step += 1
        losses.append(loss.item())
        if checkpointer is not None and state.step % every == 0:
            checkpointer.save(state)
        if kill_at is not None and state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a node lost, with an async save in flight
    if checkpointer is not None:
        checkpointer.wait()
    return losses


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a path or an object-store URL (default: a temp folder)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=16, help="a step that saves (default 16)")
    args = parser.parse_args(argv)
    if not 0 < args.every <= args.kill_at < args.steps:
        parser.error("need 0 < --every <= --kill-at < --steps")
    with tempfile.TemporaryDirectory(prefix="dcp_train-") as scratch:
        root = args.checkpoint or os.path.join(scratch, "run")
        print(f"checkpoints: {root}")
        reference = launch(args.ranks, train, None, args.steps, args.every, None, False)[0]
        try:
            launch(args.ranks, train, root, args.steps, args.every, args.kill_at, False)
            print("the job was not killed")
            return 1
        except LaunchError:
            print(f"killed every rank at step {args.kill_at}, an async save in flight")
        resumed = launch(args.ranks, train, root, args.steps, args.every, None, True)[0]
        start = next(i for i, loss in enumerate(resumed) if loss is not None) - 1
        print(f"resumed from step {start} (checkpoint {root}/step_{start:06d})")
        for step in range(start + 1, args.steps + 1):
            print(f"  step {step:3d}  loss {resumed[step]:.10f}  reference {reference[step]:.10f}")
        same = resumed[start + 1 :] == reference[start + 1 :]
        verdict = (
            "equal the uninterrupted run's, bit for bit" if same else "DIFFER from the uninterrupted run's"
        )
        print(f"losses after the restart {verdict}")
        print(f"restored: {sorted(distckpt.load_plain_tensors(f'{root}/step_{start:06d}'))[:3]} ...")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
