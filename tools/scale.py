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
the growth is easy to read (near-linear: time/shards stays flat). All of it runs with the cyclic GC
paused, as inside ``distckpt.save``.

Then what a *loading* rank pays: ``.metadata`` (pickled, every chunk of every key: each rank of
a load without the sidecar reads and unpickles all of it) against the sidecar index
``.distckpt_index``, from which a rank reads the directory and the tree nodes that meet its
share. For three ranks (first, middle, last) it queries the sidecar for that rank's own share
(same layout) and reports the bytes read and the time (the mean of the three).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distckpt.core import gc_paused  # noqa: E402
from distckpt.strategies.index import INDEX_FNAME, IndexReader  # noqa: E402
from distckpt.strategies.torch import (  # noqa: E402
    _buckets,
    _KeyDecl,
    _Record,
    _WriteItem,
    build_metadata,
    sidecar_index,
)
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


def load_boxes(metas) -> dict:
    """The boxes (stored coordinates) one rank asks for when it loads its own share."""
    boxes: dict = {}
    for m in metas:
        if m.flat is None:
            box = (m.global_offset, m.local_shape)
        else:
            grid_index = tuple(o // max(1, s) for o, s in zip(m.global_offset, m.local_shape))
            box = (grid_index + (m.flat[0],), (1,) * len(grid_index) + (m.flat[1] - m.flat[0],))
        boxes.setdefault(m.key, []).append(box)
    return boxes


def measure(world: int, tmp: Path) -> dict:
    all_metas, all_items = [], []
    for rank in range(world):
        metas, items = rank_shards(rank, world)
        all_metas.append(metas)
        all_items.append(items)
    shards = sum(len(m) for m in all_metas)
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    with gc_paused():
        t0 = time.perf_counter()
        validate_global_integrity(all_metas)
        t_validate = time.perf_counter() - t0
        t0 = time.perf_counter()
        for items in all_items:  # every rank plans its own files; rank 0's share is 1/world of this
            _buckets(items, 2)
        t_plan = time.perf_counter() - t0
        records = [records_of(rank, items) for rank, items in enumerate(all_items)]
        decls = decls_of(all_items, world)
        rss1 = proc.memory_info().rss
        t0 = time.perf_counter()
        md = build_metadata([(decls if r == 0 else {}, recs) for r, recs in enumerate(records)], "sim")
        t_meta = time.perf_counter() - t0
        peak = max(rss1, proc.memory_info().rss) - rss0
        t0 = time.perf_counter()
        md_bytes = pickle.dumps(md)
        t_pickle = time.perf_counter() - t0
        chunks = sum(len(v.chunks) for v in md.state_dict_metadata.values())
        del md
        per_rank = [(decls if r == 0 else {}, recs, {}) for r, recs in enumerate(records)]
        t0 = time.perf_counter()
        index = sidecar_index(per_rank, len(md_bytes))
        t_index = time.perf_counter() - t0
        peak = max(peak, proc.memory_info().rss - rss0)
        (tmp / ".metadata").write_bytes(md_bytes)
        (tmp / INDEX_FNAME).write_bytes(index)
        del per_rank, records
        t0 = time.perf_counter()
        pickle.loads(md_bytes)
        t_unpickle = time.perf_counter() - t0
        read_bytes, read_s, found = [], [], []
        for rank in (0, world // 2, world - 1):
            t0 = time.perf_counter()
            reader = IndexReader.open(tmp)
            hits = reader.query(load_boxes(all_metas[rank]))
            read_s.append(time.perf_counter() - t0)
            read_bytes.append(reader.bytes_read)
            found.append(sum(len(v) for v in hits.values()))
    pp, dp = layout(world)
    return {"ranks": world, "layout": f"TP{TP}xPP{pp}xDP{dp}", "shards": shards,
            "written_items": sum(len(m) for m in all_items), "validate_s": t_validate, "plan_s": t_plan,
            "metadata_s": t_meta, "total_s": t_validate + t_plan + t_meta, "rss_growth_mib": peak / 2**20,
            "chunks_in_metadata": chunks, "pickle_s": t_pickle, "index_build_s": t_index,
            "metadata_mib": len(md_bytes) / 2**20, "index_mib": len(index) / 2**20, "unpickle_s": t_unpickle,
            "share_shards": len(all_metas[0]), "load_records": sum(found) / len(found),
            "load_index_kib": sum(read_bytes) / len(read_bytes) / 2**10, "load_index_s": sum(read_s) / len(read_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--tmp", default=None, help="where the simulated .metadata and sidecar are written")
    args = parser.parse_args()
    worlds = [w for w in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384) if w <= args.max_ranks]
    rows = []
    print(f"| {'ranks':>5} | {'layout':>15} | {'shards':>9} | {'validate s':>10} | {'plan s':>7} | "
          f"{'metadata s':>10} | {'total s':>7} | {'us/shard':>8} | {'RSS +MiB':>8} |")
    print("|" + "|".join("-" * (n + 2) for n in (5, 15, 9, 10, 7, 10, 7, 8, 8)) + "|")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for world in worlds:
            r = measure(world, Path(tmp))
            rows.append(r)
            print(f"| {r['ranks']:5d} | {r['layout']:>15} | {r['shards']:9d} | {r['validate_s']:10.2f} | "
                  f"{r['plan_s']:7.2f} | {r['metadata_s']:10.2f} | {r['total_s']:7.2f} | "
                  f"{1e6 * r['total_s'] / r['shards']:8.2f} | {r['rss_growth_mib']:8.0f} |", flush=True)
    first, last = rows[0], rows[-1]
    growth = (last["total_s"] / first["total_s"]) / (last["shards"] / first["shards"])
    print(f"\n{first['ranks']} -> {last['ranks']} ranks: shards x{last['shards'] / first['shards']:.0f}, "
          f"time x{last['total_s'] / first['total_s']:.1f} (time growth / shard growth = {growth:.2f}; 1.0 is linear)")
    print("\nWhat one loading rank reads to find its share (same layout; mean of ranks 0, world/2, world-1):\n")
    print(f"| {'ranks':>5} | {'.metadata MiB':>13} | {'pickle s':>8} | {'unpickle s':>10} | {'index MiB':>9} | "
          f"{'build s':>7} | {'share shards':>12} | {'records read':>12} | {'index KiB read':>14} | {'query s':>7} |")
    print("|" + "|".join("-" * (n + 2) for n in (5, 13, 8, 10, 9, 7, 12, 12, 14, 7)) + "|")
    for r in rows:
        print(f"| {r['ranks']:5d} | {r['metadata_mib']:13.1f} | {r['pickle_s']:8.2f} | {r['unpickle_s']:10.2f} | "
              f"{r['index_mib']:9.1f} | {r['index_build_s']:7.2f} | {r['share_shards']:12d} | "
              f"{r['load_records']:12.0f} | {r['load_index_kib']:14.0f} | {r['load_index_s']:7.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
