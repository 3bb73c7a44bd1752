"""What the benchmarks share: the GPT-like state, the raw-I/O baseline, the rank launcher.

Every benchmark compares distckpt with the physical limit of its storage: the same bytes written
with plain ``os.write`` + ``fsync`` (:func:`raw_write`) and read with plain ``os.preadv``
(:func:`raw_read`), on the same storage and in the same run. This module holds that baseline, the
sharded state dicts the benchmarks save and load (:func:`build_state`, sized by
:func:`model_dims`), the launcher of gloo ranks (:func:`spawn_ranks`), the timing between
barriers (:func:`barrier_time`), the peak-RSS sampler (:class:`PeakRss`), a local moto S3 server
(:func:`start_moto`) and the chart set-up (:func:`pyplot`). It imports no other benchmark.
For the GPU benchmark: the raw baseline over several files at once (:func:`balanced_groups`,
:func:`parallel_raw_write`, :func:`parallel_raw_read`), exactly pinned host buffers
(:func:`pinned_like`) and this process's memory (:func:`rss_bytes`, :func:`proc_status_bytes`).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

# --------------------------------------------------------------------------- the state dict


def model_dims(size_gib: float):
    """Hidden size and layer count whose state (bf16 params + 2 fp32 optimizer states, i.e.
    10 bytes per weight element) is about ``size_gib``; 12 h^2 weight elements per layer."""
    hidden = 1024 if size_gib >= 1 else 512
    per_layer = 12 * hidden * hidden * 10
    layers = max(1, round(size_gib * 2**30 / per_layer))
    return hidden, layers


def build_state(
    rank: int,
    world: int,
    hidden: int,
    layers: int,
    pieces_per_rank: int = 1,
    with_data: bool = True,
    full: bool = False,
):
    """The sharded state dict of one rank.

    ``pieces_per_rank`` > 1: a TP split of ``world * pieces_per_rank`` pieces, rank r taking
    pieces r, r + world, ... (interleaved), to load under a layout other than the saved one.
    ``full``: every rank holds everything (TP1 x DP-world), replicas by rank.
    """
    from distckpt import ShardedTensor

    g = torch.Generator().manual_seed(1234 + rank)
    parts = 1 if full else world * pieces_per_rank
    mine = [0] if full else [rank + k * world for k in range(pieces_per_rank)]
    replica = rank if full else 0
    h = hidden
    sd = {}

    def make(shape, dtype):
        if not with_data:
            return torch.empty(shape, dtype=dtype)
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)

    for layer in range(layers):
        prefix = f"decoder.layers.{layer}"
        for name, shape, axis in [
            ("self_attention.linear_qkv.weight", (3 * h, h), 0),
            ("self_attention.linear_proj.weight", (h, h), 1),
            ("mlp.linear_fc1.weight", (4 * h, h), 0),
            ("mlp.linear_fc2.weight", (h, 4 * h), 1),
        ]:
            key = f"{prefix}.{name}"
            local = list(shape)
            local[axis] //= parts
            for p in mine:
                tag = f"{key}#{p}"
                sd[tag] = ShardedTensor.from_rank_offsets(
                    key, make(tuple(local), torch.bfloat16), (axis, p, parts), replica_id=replica
                )
                chunk = (local[0], local[1])
                numel = chunk[0] * chunk[1]
                for state in ("exp_avg", "exp_avg_sq"):
                    okey = f"optimizer.state.{state}.{key}"
                    sd[f"{okey}#{p}"] = ShardedTensor.from_rank_offsets_flat(
                        okey,
                        make((numel,), torch.float32),
                        chunk,
                        (axis, p, parts),
                        flattened_range=slice(0, numel),
                        replica_id=replica,
                    )
        for ln in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
            key = f"{prefix}.{ln}"
            sd[key] = ShardedTensor.from_rank_offsets(key, make((h,), torch.float32), replica_id=rank)
    return sd


def local_bytes(sd, main_only: bool = False) -> int:
    """The bytes of the tensors in ``sd`` (with ``main_only``, of its main replicas alone)."""
    from distckpt.mapping import is_main_replica

    return sum(
        sh.data.numel() * sh.data.element_size()
        for sh in sd.values()
        if not main_only or is_main_replica(sh.replica_id)
    )


def empty_like_request(sd):
    """A load request for ``sd``: the same shards over fresh zeroed tensors."""
    from dataclasses import replace

    # zeros, not empty: touch the pages now so no measurement pays for first-touch page faults
    return {k: replace(sh, data=torch.zeros_like(sh.data)) for k, sh in sd.items()}


# --------------------------------------------------------------------------- the raw-I/O baseline


def raw_write(path: Path, tensors) -> None:
    """The write limit: every tensor's bytes into one file with ``os.write``, then ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, tensors) -> None:
    """The read limit: the file's bytes, in order, into ``tensors`` with ``os.preadv``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while view:
                n = os.preadv(fd, [view], offset)
                view = view[n:]
                offset += n
    finally:
        os.close(fd)


def raw_put(store, name: str, tensors) -> None:
    """The write limit of an object store: the tensors' bytes as one object ``name`` of ``store``
    (a distckpt ``ObjectStore``), one ``obstore.put`` with the store's part size and concurrency."""
    import obstore

    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]
    obstore.put(
        store._store,
        store._key(name),
        iter(views),
        chunk_size=store.part_size,
        max_concurrency=store.max_concurrency,
    )


def raw_get(store, name: str, tensors) -> None:
    """The read limit of an object store: object ``name`` of ``store``, one ``obstore.get``, its
    bytes in order into ``tensors``."""
    import obstore

    data = memoryview(obstore.get(store._store, store._key(name)).bytes())
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        t.reshape(-1).view(torch.uint8).numpy()[:] = data[offset : offset + n]
        offset += n


def balanced_groups(items, count: int, size):
    """``items`` in at most ``count`` groups of about equal total ``size`` (largest first, each into
    the lightest group so far): how a save spreads its items over its files."""
    groups = [[] for _ in range(max(1, min(count, len(items))))]
    totals = [0] * len(groups)
    for it in sorted(items, key=size, reverse=True):
        g = totals.index(min(totals))
        groups[g].append(it)
        totals[g] += size(it)
    return groups


def parallel_raw_write(paths, groups) -> None:
    """:func:`raw_write` of each group of tensors into its own file, one thread per file."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(paths))) as pool:
        for f in [pool.submit(raw_write, p, g) for p, g in zip(paths, groups)]:
            f.result()


def parallel_raw_read(paths, groups) -> None:
    """:func:`raw_read` of each file into its group of tensors, one thread per file."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(paths))) as pool:
        for f in [pool.submit(raw_read, p, g) for p, g in zip(paths, groups)]:
            f.result()


def pinned_like(tensors):
    """Page-locked host buffers shaped like ``tensors``, pinned to their exact size (an ordinary
    allocation registered with ``cudaHostRegister``, as distckpt's staging does; torch's pinned
    allocator where registering fails), and a function that unregisters them. Without CUDA: plain
    host buffers."""
    if not torch.cuda.is_available():
        return [torch.empty(t.shape, dtype=t.dtype) for t in tensors], lambda: None
    cudart = torch.cuda.cudart()
    out, registered = [], []
    for t in tensors:
        buf = torch.empty(t.shape, dtype=t.dtype)
        nbytes = buf.numel() * buf.element_size()
        if nbytes and cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0) == cudart.cudaError.success:
            registered.append(buf.data_ptr())
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.append(buf)

    def unpin():
        for ptr in registered:
            cudart.cudaHostUnregister(ptr)
        registered.clear()

    return out, unpin


def rss_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``; psutil where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def proc_status_bytes(field: str):
    """A ``kB`` field of ``/proc/self/status`` (``VmLck``, ``VmPin`` ...) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def copy_all(dst, src) -> None:
    """The staging limit: a memcpy of every tensor of ``src`` into ``dst``."""
    for d, t in zip(dst, src):
        d.copy_(t)


def drop(path: Path) -> None:
    """Remove a checkpoint directory, if there is one."""
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- ranks and timing


def free_port() -> int:
    """A free TCP port of 127.0.0.1 for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, ranks: int, args, cleanup=None):
    """Run ``target(rank, ranks, port, args, queue)`` in ``ranks`` spawned processes (gloo over a
    free port of 127.0.0.1); ``cleanup()`` runs when they are done, whatever happened. Returns what
    rank 0 put on the queue."""
    port = free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(target, args=(ranks, port, args, queue), nprocs=ranks)
    finally:
        if cleanup is not None:
            cleanup()
    return queue.get()


def barrier_time(fn, *args, **kwargs):
    """Seconds from a barrier before ``fn(*args, **kwargs)`` to a barrier after it, and its result."""
    import torch.distributed as tdist

    tdist.barrier()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    tdist.barrier()
    return time.perf_counter() - t0, out


def all_gather(tdist, value):
    """``value`` of every rank of the default group, in rank order."""
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, value)
    return out


class PeakRss:
    """The highest resident memory of ``proc`` (default: this process) seen while the block
    runs, sampled every ``interval`` seconds."""

    def __init__(self, proc=None, interval: float = 0.002):
        import psutil

        self.proc = proc if proc is not None else psutil.Process()
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


# --------------------------------------------------------------------------- object store, charts


def start_moto(url: str):
    """A local moto S3 server with the URL's bucket; the endpoint goes into the environment."""
    import logging
    import urllib.request

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_ALLOW_HTTP="true",
    )
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/{bucket}", method="PUT"), timeout=10)
    return server


def prepare_dir(directory: str, moto: bool):
    """Where a benchmark writes: a local directory (created) or an object-store URL (with
    ``moto``, a local moto S3 server started first). Returns a function that removes the
    directory or stops the server."""
    remote = "://" in directory
    server = start_moto(directory) if remote and moto else None
    if not remote:
        Path(directory).mkdir(parents=True, exist_ok=True)

    def cleanup():
        if not remote:
            shutil.rmtree(directory, ignore_errors=True)
        if server is not None:
            server.stop()

    return cleanup


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed
    (``pip install -e .[bench]`` adds it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
