"""Write a multi-rank distckpt checkpoint for the megatron-core interop check.

    python scripts/interop_checkpoint.py OUT_DIR [--world 4 --tp 2]

(in the project's venv, where distckpt is installed: ``bash scripts/setup.sh``.)

Saves, on WORLD gloo ranks at TP x DP, a small model state (TP splits on both axes, bf16, fp16,
int64, bool and replicated tensors) into OUT_DIR/ckpt with distckpt's ``torch_dist`` strategy,
and the full tensors into OUT_DIR/expected.pt (``{'tensors': {key: tensor}}``), the format the
megatron-core loader script compares against. The same structure is saved once before, with
other values, as a training job saves step after step: OUT_DIR/ckpt is then the save whose
``.metadata`` and sidecar rank 0 took from its last save (respelled and patched), so the check
covers that path too (the script says whether it was taken).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp


def full_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "decoder.linear_qkv.weight": torch.randn(8, 6, generator=g),
        "decoder.linear_proj.weight": torch.randn(6, 8, generator=g),
        "embedding.word_embeddings.weight": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        "decoder.fc.weight": torch.randn(4, 8, generator=g).to(torch.float16),
        "decoder.final_layernorm.weight": torch.randn(6, generator=g),
        "decoder.counter": torch.arange(5, dtype=torch.int64),
        "decoder.mask": torch.rand(4, 3, generator=g) > 0.5,
    }


def _rank(rank, world, tp, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as tdist

    import distckpt
    from distckpt import ShardedTensor
    from distckpt.strategies.torch import TorchDistSaveShardedStrategy

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    tp_rank, dp_rank = rank % tp, rank // tp
    split_axis = {
        "decoder.linear_qkv.weight": 0,
        "decoder.linear_proj.weight": 1,
        "embedding.word_embeddings.weight": 0,
        "decoder.fc.weight": 1,
    }

    def state(step: int) -> dict:
        sd = {}
        for key, full in full_tensors().items():
            full = full if step else torch.zeros_like(full)
            axis = split_axis.get(key)
            if axis is None:
                sd[key] = ShardedTensor.from_rank_offsets(key, full.clone(), replica_id=rank)
            else:
                local = full.chunk(tp, dim=axis)[tp_rank].clone()
                sd[key] = ShardedTensor.from_rank_offsets(key, local, (axis, tp_rank, tp), replica_id=dp_rank)
        sd["iteration"] = 10 * step
        return sd

    distckpt.save(state(0), out / "earlier")
    strategy = TorchDistSaveShardedStrategy()
    distckpt.save(state(1), out / "ckpt", sharded_strategy=strategy)
    if rank == 0:
        shutil.rmtree(out / "earlier")
        print(
            f"the second save took rank 0's last .metadata and sidecar: {strategy.last_save_reused_metadata}"
        )
    tdist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.world, args.tp, port, args.out), nprocs=args.world)
    torch.save({"tensors": full_tensors()}, args.out / "expected.pt")
    print(f"wrote {args.out / 'ckpt'} and {args.out / 'expected.pt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
