"""How global validation, planning and metadata building scale with the number of ranks.

    python tools/scale.py [--max-ranks 4096] [--out bench_out]

Simulates, in one process, the sharding metadata that every rank of a GPT-3 175B-like model
(96 layers, hidden 12288) would send at TP8 x PP16 x DP: bf16 parameters TP-split and replicated
over DP, and a distributed optimizer whose fp32 states (master weights, exp_avg, exp_avg_sq)
are flattened slices spread over DP. At TP8 x PP16 x DP32 = 4096 ranks this is over a million
shards. For each world size it times what rank 0 does on every save:

- validation: ``validate_global_integrity`` over every rank's shard descriptions
- planning:   assigning main replicas to files (``_buckets``), summed over all ranks (each
              rank plans only its own share, so this overstates a rank's time by ``world``x)
- metadata:   building the DCP ``Metadata`` from every rank's write records

and prints the time and the resident memory growth (validation + the Metadata object), with the ratio to the smallest world size so
the growth is easy to read (near-linear: time/shards stays flat).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distckpt.strategies.torch import _buckets, _KeyDecl, _Record, _WriteItem, build_metadata  # noqa: E402
from distckpt.validation import ShardMeta, validate_global_integrity  # noqa: E402

HIDDEN, LAYERS, VOCAB, TP, PP_MAX = 12288, 96, 51200, 8, 16
WEIGHTS = [  # name, shape (per layer), split axis (None: replicated over TP)
    ("self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), 0),
    ("self_attention.linear_qkv.bias", (3 * HIDDEN,), 0),
    ("self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1),
    ("self_attention.linear_proj.bias", (HIDDEN,), None),
    ("mlp.linear_fc1.weight", (4 * HIDDEN, HIDDEN), 0),
    ("mlp.linear_fc1.bias", (4 * HIDDEN,), 0),
    ("mlp.linear_fc2.weight", (HIDDEN, 4 * HIDDEN), 1),
    ("mlp.linear_fc2.bias", (HIDDEN,), None),
    ("input_layernorm.weight", (HIDDEN,), None),
    ("input_layernorm.bias", (HIDDEN,), None),
    ("pre_mlp_layernorm.weight", (HIDDEN,), None),
    ("pre_mlp_layernorm.bias", (HIDDEN,), None),
]
OPT_STATES = ("param", "exp_avg", "exp_avg_sq")


def layout(world: int):
    pp = min(PP_MAX, max(1, world // TP))
    dp = world // (TP * pp)
    return pp, dp


def rank_shards(rank: int, world: int):
    """The shard descriptions and write records of one simulated rank."""
    pp, dp = layout(world)
    tp_rank = rank % TP
    pp_rank = (rank // TP) % pp
    dp_rank = rank // (TP * pp)
    layers_per_stage = LAYERS // pp
    metas, items = [], []
    for layer in range(pp_rank * layers_per_stage, (pp_rank + 1) * layers_per_stage):
        for name, shape, axis in WEIGHTS:
            key = f"decoder.layers.{name}"
            gshape = (LAYERS,) + shape
            local = list(shape)
            offset = [layer] + [0] * len(shape)
            tp_replica = 0
            if axis is None:
                tp_replica = tp_rank
            else:
                local[axis] //= TP
                offset[1 + axis] = tp_rank * local[axis]
            full_local = (1,) + tuple(local)
            main = tp_replica == 0 and dp_rank == 0
            metas.append(ShardMeta(key, False, "torch.bfloat16", gshape, tuple(offset), full_local, None, main, rank))
            if main:
                items.append(_WriteItem(key, tuple(offset), full_local, None, 2 * math.prod(local)))
            numel = math.prod(local)
            cuts = [numel * i // dp for i in range(dp + 1)]
            start, stop = cuts[dp_rank], cuts[dp_rank + 1]
            for state in OPT_STATES:
                okey = f"optimizer.state.{state}.{key}"
                opt_main = tp_replica == 0
                metas.append(ShardMeta(okey, False, "torch.float32", gshape, tuple(offset), full_local,
                                       (start, stop), opt_main, rank))
                if opt_main and stop > start:
                    grid_index = (layer,) + tuple(o // max(1, s) for o, s in zip(offset[1:], local))
                    items.append(_WriteItem(okey, grid_index + (start,), (1,) * len(gshape) + (stop - start,),
                                            None, 4 * (stop - start)))
    return metas, items


def records_of(rank: int, items, buckets: int = 2):
    out = []
    for b, bucket in enumerate(_buckets(items, buckets)):
        pos = 0
        for it in bucket:
            out.append(_Record(it.fqn, it.chunk_offset, it.chunk_size, f"__{rank}_{b}.distcp", pos, it.nbytes + 1000))
            pos += it.nbytes + 1000
    return out


def decls_of(items_by_rank, world):
    decls = {}
    for name, shape, _ in WEIGHTS:
        key = f"decoder.layers.{name}"
        decls[key] = _KeyDecl(False, torch.bfloat16, (LAYERS,) + shape)
        for state in OPT_STATES:
            okey = f"optimizer.state.{state}.{key}"
            axis = [a for n, s, a in WEIGHTS if n == name][0]
            grid = (LAYERS,) + tuple(TP if a == axis else 1 for a in range(len(shape)))
            local = list(shape)
            if axis is not None:
                local[axis] //= TP
            decls[okey] = _KeyDecl(False, torch.float32, grid + (math.prod(local),), (LAYERS,) + shape)
    return decls


def measure(world: int) -> dict:
    all_metas, all_items = [], []
    for rank in range(world):
        metas, items = rank_shards(rank, world)
        all_metas.append(metas)
        all_items.append(items)
    shards = sum(len(m) for m in all_metas)
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    validate_global_integrity(all_metas)
    t_validate = time.perf_counter() - t0
    t0 = time.perf_counter()
    for items in all_items:  # every rank plans its own files; rank 0's share is 1/world of this
        _buckets(items, 2)
    t_plan = time.perf_counter() - t0
    records = [records_of(rank, items) for rank, items in enumerate(all_items)]
    decls = decls_of(all_items, world)
    t0 = time.perf_counter()
    md = build_metadata([(decls if r == 0 else {}, recs) for r, recs in enumerate(records)], "sim")
    t_meta = time.perf_counter() - t0
    peak = psutil.Process().memory_info().rss - rss0
    pp, dp = layout(world)
    return {"ranks": world, "layout": f"TP{TP}xPP{pp}xDP{dp}", "shards": shards,
            "written_items": sum(len(r) for r in records), "validate_s": t_validate, "plan_s": t_plan,
            "metadata_s": t_meta, "total_s": t_validate + t_plan + t_meta, "rss_growth_mib": peak / 2**20,
            "chunks_in_metadata": sum(len(v.chunks) for v in md.state_dict_metadata.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    worlds = [w for w in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if w <= args.max_ranks]
    rows = []
    print(f"| {'ranks':>5} | {'layout':>14} | {'shards':>9} | {'validate s':>10} | {'plan s':>7} | "
          f"{'metadata s':>10} | {'total s':>7} | {'us/shard':>8} | {'RSS +MiB':>8} |")
    print("|" + "|".join("-" * (n + 2) for n in (5, 14, 9, 10, 7, 10, 7, 8, 8)) + "|")
    for world in worlds:
        r = measure(world)
        rows.append(r)
        print(f"| {r['ranks']:5d} | {r['layout']:>14} | {r['shards']:9d} | {r['validate_s']:10.2f} | "
              f"{r['plan_s']:7.2f} | {r['metadata_s']:10.2f} | {r['total_s']:7.2f} | "
              f"{1e6 * r['total_s'] / r['shards']:8.2f} | {r['rss_growth_mib']:8.0f} |", flush=True)
    first, last = rows[0], rows[-1]
    growth = (last["total_s"] / first["total_s"]) / (last["shards"] / first["shards"])
    print(f"\n{first['ranks']} -> {last['ranks']} ranks: shards x{last['shards'] / first['shards']:.0f}, "
          f"time x{last['total_s'] / first['total_s']:.1f} (time growth / shard growth = {growth:.2f}; 1.0 is linear)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
