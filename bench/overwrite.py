"""Benchmark what an overwrite on an object store costs over a save to a fresh prefix.

    python -m bench.overwrite --dir s3://bench/ow --moto --size-gib 0.1 --reps 5
    python -m bench.overwrite --dir s3://bench/ow --moto --size-gib 0.1 --reps 5 --backend zarr

One process (no process group), a local moto S3 server (``--moto``; or any ``--dir`` the
environment reaches). Per repetition, interleaved so that the machine's load hits all alike:

- raw: ``obstore.put`` of the same bytes as one object (the physical limit of the link);
- fresh: ``distckpt.save`` to a new prefix (written in place, ``metadata.json`` by conditional put);
- overwrite: ``distckpt.save(overwrite=True)`` over that checkpoint (names of its own, the commit
  record, then the publication and the clean-up, all within the call: distckpt.commit_store);
- load: ``distckpt.load`` of the overwritten checkpoint (through its commit record).

Prints the medians, each save's ratio to the raw put, and overwrite / fresh.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from bench.common import build_state, model_dims, raw_put, start_moto


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", required=True, help="an object-store URL (s3://bucket/prefix)")
    parser.add_argument("--moto", action="store_true", help="start a local moto S3 server for --dir first")
    parser.add_argument("--size-gib", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="torch_dist", choices=("torch_dist", "zarr"))
    args = parser.parse_args()
    server = start_moto(args.dir) if args.moto else None
    try:
        import distckpt
        from distckpt.storage import open_store

        hidden, layers = model_dims(args.size_gib)
        sd = build_state(0, 1, hidden, layers)
        tensors = [v.data for v in sd.values() if isinstance(v, distckpt.ShardedTensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        root = open_store(args.dir)
        times = {"raw put": [], "fresh save": [], "overwrite save": [], "load": []}
        strategy = (args.backend, 1)

        for rep in range(args.reps + 1):  # the first pass warms up
            url = f"{args.dir.rstrip('/')}/{uuid.uuid4().hex[:8]}"
            got = {
                "raw put": _timed(lambda: raw_put(root, "raw.bin", tensors)),
                "fresh save": _timed(lambda u=url: distckpt.save(sd, u, sharded_strategy=strategy)),
                "overwrite save": _timed(
                    lambda u=url: distckpt.save(sd, u, sharded_strategy=strategy, overwrite=True)
                ),
                "load": _timed(
                    lambda u=url: distckpt.load(build_state(0, 1, hidden, layers, with_data=False), u)
                ),
            }
            if rep:
                for name, seconds in got.items():
                    times[name].append(seconds)
            store = open_store(url)
            for name in store.list_objects():
                store.delete(name)
        root.delete("raw.bin")
        med = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"{args.backend}, {nbytes / 2**30:.3f} GiB, medians of {args.reps} (the first pass not counted)"
        )
        for name, seconds in med.items():
            ratio = f"  {seconds / med['raw put']:.2f}x of raw put" if "save" in name else ""
            print(f"  {name:15s} {seconds:7.3f} s{ratio}")
        print(f"  overwrite / fresh save: {med['overwrite save'] / med['fresh save']:.2f}")
        return 0
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
