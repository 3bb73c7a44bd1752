"""How global validation, planning and metadata building scale with the number of ranks.

    python -m bench.scale [--max-ranks 4096] [--out bench_out] [--tmp /dev/shm] [--profile]
                          [--model gpt3|deepseek] [--ep 8]

``--model deepseek`` simulates instead a DeepSeek-V3-like Mixture-of-Experts model
(:mod:`bench.deepseek`: 61 layers x 256 routed + 1 shared expert, PP16, expert parallelism
``--ep`` carved out of DP), whose expert weights are keys of 15,616 chunks each; everything below
is measured the same way. By default:

Simulates, in one process, the sharding metadata that every rank of a GPT-3 175B-like model
(96 layers, hidden 12288) would send at TP8 x PP16 x DP: bf16 parameters TP-split and replicated
over DP, and a distributed optimizer whose fp32 states (master weights, exp_avg, exp_avg_sq)
are flattened slices spread over DP. At TP8 x PP16 x DP32 = 4096 ranks this is over a million
shards. Each simulated rank builds and pickles what it sends to rank 0 with the same code as
``distckpt.save`` (a ``ShardTable`` for validation, a ``RecordTable`` at commit; not timed: the
ranks do it in parallel). For each world size it times what rank 0 does on a save with a new
structure:

- gather:     unpickling every rank's two payloads (rank 0's side of the two gathers)
- validation: ``validate_global_integrity`` over every rank's shard table
- planning:   rank 0 assigning its own main replicas to files (``buckets``)
- metadata:   merging every rank's record table and building the DCP ``Metadata`` from it

and prints the time and the peak resident memory above the simulation's inputs (sampled every
5 ms during these stages, the pickling of ``.metadata`` and the sidecar build), with the
ratio to the smallest world size so the growth is easy to read (near-linear: time/shards stays
flat). "total" is validation + planning + metadata. "reused" is the ``.metadata`` of the next save of
the same items with ``cached_metadata=True``: the last one, its two ids respelled (not in
"total"). In the second table, "template s" builds the sidecar as a ``cached_metadata`` save
keeps it (with where every CRC32C and node checksum lies) and "patched s" is the next such
save's sidecar: the template with new CRC32Cs patched in. All of it runs with the cyclic GC paused,
as inside ``distckpt.save``. ``--profile`` prints a cProfile of those stages at the largest
world size.

Then what a *loading* rank pays: ``.metadata`` (pickled, every chunk of every key: each rank of
a load without the sidecar reads and unpickles all of it) against the sidecar index
``.distckpt_index``, from which a rank reads the directory and the tree nodes that meet its
share. For three ranks (first, middle, last) it queries the sidecar for that rank's own share
(same layout) and reports the bytes read and the time (the mean of the three), then plans that
share's copies (``plan s``) and reports the peak memory the query and the plan allocate (``peak
MiB``, the largest of the three; traced by tracemalloc in a second pass). Before
reading, a load checks the requests of all ranks: each rank's shard table (the same payload as
the save's validation) goes to rank 0, which alone receives all of them ("tables MiB"); every
other rank receives the slot round of the gather and the verdict ("other rank KiB") when the
stages run as collectives of the process group; through a TCPStore (the default there) it
receives the verdict alone. An all-gather of the tables, as a load did before, would hand
"tables MiB" to every rank.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import pickle
import pstats
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import torch

from bench import deepseek
from bench.common import PeakRss
from distckpt import ShardedTensor
from distckpt.core import gc_paused
from distckpt.dist import slot_bytes
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_read import IndexReader
from distckpt.formats.metadata_pickle import respell
from distckpt.strategies.torch_dist.loadplan import LoadPlan, plan_tensor
from distckpt.strategies.torch_dist.metadata import build_metadata, metadata_bytes_and_head
from distckpt.strategies.torch_dist.plan import WriteItem
from distckpt.strategies.torch_dist.plan import buckets as buckets_of
from distckpt.strategies.torch_dist.records import (
    GatheredRecords,
    KeyDecl,
    Record,
    RecordTable,
    patched_sidecar_index,
    sidecar_index,
)
from distckpt.strategies.torch_dist.stored import index_from_sidecar
from distckpt.validation import ShardTable, validate_global_integrity

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
            metas.append((key, False, "torch.bfloat16", gshape, tuple(offset), full_local, None, main))
            if main:
                items.append(WriteItem(key, tuple(offset), full_local, None, 2 * math.prod(local)))
            numel = math.prod(local)
            cuts = [numel * i // dp for i in range(dp + 1)]
            start, stop = cuts[dp_rank], cuts[dp_rank + 1]
            for state in OPT_STATES:
                okey = f"optimizer.state.{state}.{key}"
                opt_main = tp_replica == 0
                metas.append(
                    (okey, False, "torch.float32", gshape, tuple(offset), full_local, (start, stop), opt_main)
                )
                if opt_main and stop > start:
                    grid_index = (layer,) + tuple(o // max(1, s) for o, s in zip(offset[1:], local))
                    items.append(
                        WriteItem(
                            okey,
                            grid_index + (start,),
                            (1,) * len(gshape) + (stop - start,),
                            None,
                            4 * (stop - start),
                        )
                    )
    return metas, items


def records_of(rank: int, items, buckets: int = 2):
    out = []
    for b, bucket in enumerate(buckets_of(items, buckets)):
        pos = 0
        for it in bucket:
            out.append(
                Record(it.fqn, it.chunk_offset, it.chunk_size, f"__{rank}_{b}.distcp", pos, it.nbytes + 1000)
            )
            pos += it.nbytes + 1000
    return out


def decls_of(world):
    decls = {}
    for name, shape, _ in WEIGHTS:
        key = f"decoder.layers.{name}"
        decls[key] = KeyDecl(False, torch.bfloat16, (LAYERS,) + shape)
        for state in OPT_STATES:
            okey = f"optimizer.state.{state}.{key}"
            axis = [a for n, s, a in WEIGHTS if n == name][0]
            grid = (LAYERS,) + tuple(TP if a == axis else 1 for a in range(len(shape)))
            local = list(shape)
            if axis is not None:
                local[axis] //= TP
            decls[okey] = KeyDecl(False, torch.float32, grid + (math.prod(local),), (LAYERS,) + shape)
    return decls


def load_share(tmp: Path, metas):
    """What one rank's load of its own share (same layout) costs before it reads a byte: the
    sidecar query for its chunks (seconds, bytes read, records found), the planning of its copies
    (seconds), and the peak of the memory both allocate (bytes, traced in a second pass: the
    tracing slows them). The request's tensors are on the meta device: the plan is the same, no
    memory is filled."""
    sd = {}
    for i, (key, _, dtype, gshape, offset, local, flat, _) in enumerate(metas):
        dt = getattr(torch, dtype.split(".")[-1])
        n = math.prod(local) if flat is None else flat[1] - flat[0]
        data = torch.empty(local if flat is None else (n,), dtype=dt, device="meta")
        fr = None if flat is None else slice(*flat)
        sd[i] = ShardedTensor(key, data, dt, local, gshape, offset, None, 0, 0, False, fr)

    def query_and_plan():
        t0 = time.perf_counter()
        reader = IndexReader.open(tmp)
        index = index_from_sidecar(reader, sd, {})
        t_query = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = LoadPlan()
        for sh in sd.values():
            plan_tensor(plan, sh, index[sh.key], sh.data)
        return t_query, time.perf_counter() - t0, reader, index, plan

    t_query, t_plan, reader, index, _ = query_and_plan()
    tracemalloc.start()
    kept = query_and_plan()  # what it allocates, and keeps until the load reads
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del kept
    found = sum(len(k.chunks) for k in index.values() if hasattr(k, "chunks"))
    return t_query, t_plan, reader.bytes_read, found, peak


class Gpt3:
    """The GPT-3 175B-like model above, at TP8 x PP16 x DP."""

    name = "GPT-3 175B-like"

    def layout(self, world: int) -> str:
        pp, dp = layout(world)
        return f"TP{TP}xPP{pp}xDP{dp}"

    def worlds(self, worlds):
        return list(worlds)

    rank_shards = staticmethod(rank_shards)
    decls_of = staticmethod(decls_of)


class DeepSeek:
    """The DeepSeek-V3-like MoE model of :mod:`bench.deepseek`, at PP16 x DP with EP ``ep``."""

    def __init__(self, ep: int):
        self.ep = ep
        self.name = f"DeepSeek-V3-like, EP{ep}"

    def layout(self, world: int) -> str:
        pp, dp, edp = deepseek.layout(world, self.ep)
        return f"PP{pp}xDP{dp} EP{self.ep}xEDP{edp}"

    def worlds(self, worlds):
        return [w for w in worlds if w // deepseek.PP >= self.ep]

    def rank_shards(self, rank: int, world: int):
        return deepseek.rank_shards(rank, world, self.ep)

    def decls_of(self, world: int):
        return deepseek.decls_of(world, self.ep)


def measure(world: int, tmp: Path, profile: bool = False, objects: bool = False, model=None) -> dict:
    model = model or Gpt3()
    queried = (0, world // 2, world - 1)
    all_metas, payloads, records, shards = {}, [], [], 0
    decls = model.decls_of(world)
    for rank in range(world):
        metas, items = model.rank_shards(rank, world)
        shards += len(metas)
        if rank in queried:
            all_metas[rank] = metas
        # What each rank sends (built and pickled on that rank, in parallel: not timed).
        payloads.append(pickle.dumps(ShardTable.build(rank, metas)))
        recs = records_of(rank, items)
        rank_decls = {it.fqn: decls[it.fqn] for it in items}
        records.append(pickle.dumps(("full", RecordTable.of(rank_decls, recs), {})))
        if rank == 0:
            planned = items
    written = sum(len(pickle.loads(p)[1].rows) for p in records)
    tables_bytes = sum(len(p) for p in payloads)
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    profiler = cProfile.Profile() if profile else None
    with gc_paused(), PeakRss(proc, interval=0.005) as peak:
        if profiler:
            profiler.enable()
        t0 = time.perf_counter()
        tables = [pickle.loads(p) for p in payloads]  # rank 0's side of the validation gather
        t_gather = time.perf_counter() - t0
        t0 = time.perf_counter()
        validate_global_integrity(tables)
        t_validate = time.perf_counter() - t0
        del tables
        t0 = time.perf_counter()
        buckets_of(planned, 2)  # each rank plans its own files: rank 0's share
        t_plan = time.perf_counter() - t0
        t0 = time.perf_counter()
        gathered = [pickle.loads(p) for p in records]  # rank 0's side of the commit gather
        t_gather += time.perf_counter() - t0
        t0 = time.perf_counter()
        merged = GatheredRecords.of([p[1] for p in gathered])
        md_bytes, head = metadata_bytes_and_head(merged, "sim", "save-id")
        t_meta = time.perf_counter() - t0
        if profiler:
            profiler.disable()
        t0 = time.perf_counter()
        index = sidecar_index(merged, len(md_bytes))
        t_index = time.perf_counter() - t0
        # The sidecar of the next save of the same items with cached_metadata: the last one kept
        # as a template (built once, with the first such save), new CRC32Cs patched in.
        t0 = time.perf_counter()
        _, template = sidecar_index(merged, len(md_bytes), template=True)
        t_template = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        next_save = GatheredRecords.of(
            [p[1].with_crcs(rng.integers(0, 2**32, len(p[1].rows))) for p in gathered]
        )
        t0 = time.perf_counter()
        patched = patched_sidecar_index(template, next_save, len(md_bytes))
        t_patched = time.perf_counter() - t0
        if patched is None:
            raise RuntimeError("the simulated sidecar could not be patched")
        del template, next_save, patched
        # The next save of the same items with cached_metadata: last .metadata, its ids changed.
        cached = bytearray(md_bytes)
        t0 = time.perf_counter()
        again = respell(cached, head, [("sim", "/sim/next"), ("save-id", "save-id-2")])
        t_reused = time.perf_counter() - t0
        if again is None:
            raise RuntimeError("the simulated .metadata could not be reused")
        del cached
    t_objects = None
    if objects:  # the same .metadata the way it was built before: DCP's objects, then pickle (not in RSS)
        with gc_paused():
            t0 = time.perf_counter()
            pickle.dumps(build_metadata(merged, "sim"))
            t_objects = time.perf_counter() - t0
    del merged, gathered
    (tmp / ".metadata").write_bytes(md_bytes)
    (tmp / INDEX_FNAME).write_bytes(index)
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(22)
        print(out.getvalue())
    with gc_paused():
        t0 = time.perf_counter()
        md = pickle.loads(md_bytes)
        t_unpickle = time.perf_counter() - t0
        chunks = sum(len(v.chunks) for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
        del md
        read_bytes, read_s, plan_s, found, plan_rss = [], [], [], [], []
        for rank in queried:
            q, p, nbytes, records_found, rss = load_share(tmp, all_metas[rank])
            read_s.append(q)
            plan_s.append(p)
            read_bytes.append(nbytes)
            found.append(records_found)
            plan_rss.append(rss)
    return {
        "ranks": world,
        "layout": model.layout(world),
        "shards": shards,
        "written_items": written,
        "gather_s": t_gather,
        "validate_s": t_validate,
        "plan_s": t_plan,
        "metadata_s": t_meta,
        "metadata_reused_s": t_reused,
        "total_s": t_validate + t_plan + t_meta,
        "rss_growth_mib": (peak.peak - rss0) / 2**20,
        "chunks_in_metadata": chunks,
        "objects_and_pickle_s": t_objects,
        "index_build_s": t_index,
        "index_template_s": t_template,
        "index_patched_s": t_patched,
        "metadata_mib": len(md_bytes) / 2**20,
        "index_mib": len(index) / 2**20,
        "unpickle_s": t_unpickle,
        "share_shards": len(all_metas[0]),
        "load_records": sum(found) / len(found),
        "load_index_kib": sum(read_bytes) / len(read_bytes) / 2**10,
        "load_index_s": sum(read_s) / len(read_s),
        "load_plan_s": sum(plan_s) / len(plan_s),
        "load_mem_mib": max(plan_rss) / 2**20,
        "load_tables_mib": tables_bytes / 2**20,
        # the slot all-gather (world slots) and the verdict's broadcast (one slot)
        "load_other_rank_kib": (world + 1) * slot_bytes(world) / 2**10,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--min-ranks", type=int, default=64)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--tmp", default=None, help="where the simulated .metadata and sidecar are written")
    parser.add_argument(
        "--objects",
        action="store_true",
        help="also time building DCP's Metadata objects and pickling them (the old way)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile gather + validation + planning + metadata at the largest world size",
    )
    parser.add_argument(
        "--model",
        choices=["gpt3", "deepseek"],
        default="gpt3",
        help="GPT-3 175B-like at TP8xPP16xDP, or DeepSeek-V3-like MoE at PP16xDP (bench/deepseek.py)",
    )
    parser.add_argument("--ep", type=int, default=8, help="expert parallelism of --model deepseek")
    args = parser.parse_args()
    model = DeepSeek(args.ep) if args.model == "deepseek" else Gpt3()
    worlds = model.worlds(
        w for w in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384) if args.min_ranks <= w <= args.max_ranks
    )
    print(f"{model.name}: rank 0's side of a save with a new structure\n")
    rows = []
    print(
        f"| {'ranks':>5} | {'layout':>22} | {'shards':>9} | {'items':>9} | {'gather s':>8} | "
        f"{'validate s':>10} | "
        f"{'plan s':>7} | {'metadata s':>10} | {'total s':>7} | {'us/shard':>8} | {'RSS +MiB':>8} | "
        f"{'reused s':>8} |"
    )
    print("|" + "|".join("-" * (n + 2) for n in (5, 22, 9, 9, 8, 10, 7, 10, 7, 8, 8, 8)) + "|")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for world in worlds:
            r = measure(
                world,
                Path(tmp),
                profile=args.profile and world == worlds[-1],
                objects=args.objects,
                model=model,
            )
            rows.append(r)
            print(
                f"| {r['ranks']:5d} | {r['layout']:>22} | {r['shards']:9d} | {r['written_items']:9d} | "
                f"{r['gather_s']:8.2f} | {r['validate_s']:10.2f} | "
                f"{r['plan_s']:7.2f} | {r['metadata_s']:10.2f} | {r['total_s']:7.2f} | "
                f"{1e6 * r['total_s'] / r['shards']:8.2f} | {r['rss_growth_mib']:8.0f} | "
                f"{r['metadata_reused_s']:8.3f} |",
                flush=True,
            )
    first, last = rows[0], rows[-1]
    growth = (last["total_s"] / first["total_s"]) / (last["shards"] / first["shards"])
    print(
        f"\n{first['ranks']} -> {last['ranks']} ranks: shards x{last['shards'] / first['shards']:.0f}, "
        f"time x{last['total_s'] / first['total_s']:.1f} (time growth / shard growth = {growth:.2f}; "
        f"1.0 is linear)"
    )
    print(
        "\nWhat one loading rank reads to find its share (same layout; mean of ranks 0, world/2, world-1):\n"
    )
    print(
        f"| {'ranks':>5} | {'.metadata MiB':>13} | {'objects s':>9} | {'unpickle s':>10} | "
        f"{'index MiB':>9} | "
        f"{'build s':>7} | {'template s':>10} | {'patched s':>9} | {'share shards':>12} | "
        f"{'records read':>12} | {'index KiB read':>14} | {'query s':>7} | {'plan s':>6} | {'peak MiB':>8} | "
        f"{'tables MiB':>10} | {'other rank KiB':>14} |"
    )
    print(
        "|" + "|".join("-" * (n + 2) for n in (5, 13, 9, 10, 9, 7, 10, 9, 12, 12, 14, 7, 6, 8, 10, 14)) + "|"
    )
    for r in rows:
        objects = "-" if r["objects_and_pickle_s"] is None else f"{r['objects_and_pickle_s']:.2f}"
        print(
            f"| {r['ranks']:5d} | {r['metadata_mib']:13.1f} | {objects:>9} | {r['unpickle_s']:10.2f} | "
            f"{r['index_mib']:9.1f} | {r['index_build_s']:7.2f} | {r['index_template_s']:10.2f} | "
            f"{r['index_patched_s']:9.2f} | {r['share_shards']:12d} | "
            f"{r['load_records']:12.0f} | {r['load_index_kib']:14.0f} | {r['load_index_s']:7.3f} | "
            f"{r['load_plan_s']:6.3f} | {r['load_mem_mib']:8.1f} | "
            f"{r['load_tables_mib']:10.1f} | {r['load_other_rank_kib']:14.0f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"scale_{args.model}{args.ep if args.model == 'deepseek' else ''}.json").write_text(
        json.dumps(rows, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
