"""Megatron-Core loads a checkpoint that distckpt overwrote on an object store (needs the
``megatron`` extra).

An overwrite names its data files with the save's token (``<token>__R_B.distcp``,
distckpt.commit_store) and ``.metadata`` records those names; DCP's reader, which Megatron-Core's
``dist_checkpointing.load`` uses, opens data files by the names ``.metadata`` records. Two gloo
ranks save twice to S3 (moto), the second time over the first; the plain names are then copied to
a local directory, as ``aws s3 sync`` would, and Megatron-Core loads them, resharded.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import distckpt
from distckpt import dist as ddist
from distckpt.storage import open_store
from distckpt.storage.record import is_internal, token_in
from tests.support.harness import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")


def _weight(step: int) -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) + 100 * step


def _save_twice_then_megatron_loads(url: str, local: str):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = ddist.get_rank(), ddist.get_world_size()
    for step, overwrite in ((1, None), (2, True)):
        rows = _weight(step)[4 * rank : 4 * rank + 4].clone()
        distckpt.save(
            {"w": ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)), "step": step},
            url,
            overwrite=overwrite,
        )
    if rank == 0:
        store = open_store(url)
        for name in store.list_objects():
            if not is_internal(name):
                target = os.path.join(local, name)
                with open(target, "wb") as f:
                    f.write(bytes(store.get_versioned(name)[0]))
    ddist.barrier()
    # Megatron-Core reads the copy resharded: rank r asks for columns [3r, 3r + 3) of every row.
    cols = torch.zeros(8, 3)
    request = {"w": ShardedTensor.from_rank_offsets("w", cols, (1, rank, world))}
    loaded = dist_checkpointing.load(request, local)
    return torch.equal(loaded["w"], _weight(2)[:, 3 * rank : 3 * rank + 3])


def test_megatron_loads_an_overwritten_object_store_checkpoint_with_token_named_files(s3_url, tmp_path):
    assert run_ranks(2, _save_twice_then_megatron_loads, s3_url, str(tmp_path), timeout=120) == [True, True]
    data = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert data and all(token_in(name) for name in data), data  # <token>__R_B.distcp
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    assert {info.relative_path for info in metadata.storage_data.values()} == set(data)
