"""The ``zarr`` strategy: on-disk layout, readers outside distckpt, dtypes, chunk grids, legacy
Megatron-Core checkpoints, resharding that reads only what it needs, and clear errors.

The behaviour every strategy shares is in test_conformance.py; these tests are about zarr.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor, check_is_distributed_checkpoint
from distckpt import dist as ddist
from distckpt.formats.manifest import read_manifest, verify_files
from distckpt.strategies import zarr as zs
from tests.support import layouts
from tests.support.harness import expect_all_ranks_raise, run_ranks
from tests.support.layouts import splits

DATA = Path(__file__).parents[1] / "data"
LEGACY = DATA / "megatron-0.15.3" / "tp2_zarr"


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _recorded(method: str):
    """Record the chunk files that RawIO.<method> ("write" or "read") touches in this process
    (writes go to the save's staging directory; recorded under the checkpoint's own path)."""
    paths = []
    original = getattr(zs.RawIO, method)

    def spy(self, jobs, *args):
        paths.extend(
            re.sub(r"/\.([^/]+)\.distckpt-staging-[0-9a-f]+/", r"/\1/", str(j.meta.chunk_path(j.index)))
            for j in jobs
        )
        return original(self, jobs, *args)

    setattr(zs.RawIO, method, spy)
    try:
        yield paths
    finally:
        setattr(zs.RawIO, method, original)


def _chunk_files(ckpt, key):
    root = Path(ckpt) / key / "c"
    return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _zarr_json(ckpt, key):
    return json.loads((Path(ckpt) / key / "zarr.json").read_text())


def _bits(t):
    """Compare tensors bit by bit (NaN payloads included)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    size = t.element_size()
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[size]
    )


def _save_layout(ckpt, layout, params, strategy_kwargs=None):
    sd, _ = layouts.build(layout, ddist.get_rank(), ddist.get_world_size(), True, **params)
    strategy = zs.ZarrSaveShardedStrategy(**(strategy_kwargs or {}))
    with _recorded("write") as written:
        distckpt.save(sd, ckpt, sharded_strategy=strategy)
    return written


def _load_layout(ckpt, layout, params, strategy_kwargs=None):
    sd, pieces = layouts.build(layout, ddist.get_rank(), ddist.get_world_size(), False, **params)
    strategy = zs.ZarrLoadShardedStrategy(**(strategy_kwargs or {}))
    with _recorded("read") as read:
        loaded = distckpt.load(sd, ckpt, sharded_strategy=strategy)
    wrong = [
        name
        for name, piece in pieces.items()
        if loaded[name].dtype != piece.expected().dtype or not torch.equal(loaded[name], piece.expected())
    ]
    return len(pieces), wrong, sorted(set(read))


# --------------------------------------------------------------------------- layout on disk


def test_format_version_1_request_writes_the_version_2_layout(tmp_path):
    sd, _ = layouts.build("tp_dp", 0, 1, True, tp=1)
    distckpt.save(sd, tmp_path, sharded_strategy=("zarr", 1))
    assert json.loads((tmp_path / "metadata.json").read_text()) == {
        "sharded_backend": "zarr",
        "sharded_backend_version": 2,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    root = json.loads((tmp_path / "zarr.json").read_text())
    assert root["node_type"] == "group"
    assert root["attributes"]["distckpt"]["keys"] == sorted(
        ["col", "row", "emb", "half", "bias", "count", "mask", "steps"]
    )
    col = _zarr_json(tmp_path, "col")
    assert (col["zarr_format"], col["data_type"], col["codecs"]) == (
        3,
        "float32",
        [{"name": "bytes", "configuration": {"endian": "little"}}],
    )


def test_chunk_grid_is_the_shard_grid_and_each_rank_writes_its_own_chunks(tmp_path):
    written = run_ranks(4, _save_layout, str(tmp_path), "grid", {"rows": 2, "cols": 2})
    assert _zarr_json(tmp_path, "grid")["chunk_grid"]["configuration"]["chunk_shape"] == [4, 6]
    assert [sorted(w) for w in written] == [
        [str(tmp_path / "grid" / "c" / f"{r}" / f"{c}")] for r in (0, 1) for c in (0, 1)
    ]


def _save_uneven_rows(ckpt, cuts):
    rank = ddist.get_rank()
    full = layouts.full_tensor("u", (cuts[-1], 3))
    lo, hi = cuts[rank], cuts[rank + 1]
    sh = ShardedTensor(
        "u", full[lo:hi].clone(), torch.float32, (hi - lo, 3), tuple(full.shape), (lo, 0), None, 0
    )
    with _recorded("write") as written:
        distckpt.save({"u": sh}, ckpt, sharded_strategy=("zarr", 2))
    return written


def test_uneven_cuts_give_a_gcd_chunk_grid_with_one_writer_per_chunk(tmp_path):
    cuts = [0, 6, 12, 20, 25]  # interior cuts 6, 12, 20 -> chunks of 2 rows, the last one padded
    written = run_ranks(4, _save_uneven_rows, str(tmp_path), cuts)
    assert _zarr_json(tmp_path, "u")["chunk_grid"]["configuration"]["chunk_shape"] == [2, 3]
    files = [f for w in written for f in w]
    assert len(files) == len(set(files)) == 13 and sorted(files) == _chunk_files(tmp_path, "u")
    assert [len(w) for w in written] == [3, 3, 4, 3]
    full = layouts.full_tensor("u", (25, 3))
    assert torch.equal(distckpt.load_plain_tensors(tmp_path)["u"], full)


def _save_with_empty_piece(ckpt):
    rank = ddist.get_rank()
    lo, hi = [(0, 4), (4, 4)][rank]  # rank 1 holds an empty piece
    full = layouts.full_tensor("e", (4, 2))
    sh = ShardedTensor("e", full[lo:hi].clone(), torch.float32, (hi - lo, 2), (4, 2), (lo, 0), None, 0)
    distckpt.save({"e": sh}, ckpt, sharded_strategy=("zarr", 1))


def test_empty_pieces_write_nothing_and_do_not_split_the_grid(tmp_path):
    run_ranks(2, _save_with_empty_piece, str(tmp_path))
    assert _zarr_json(tmp_path, "e")["chunk_grid"]["configuration"]["chunk_shape"] == [4, 2]
    assert torch.equal(distckpt.load_plain_tensors(tmp_path)["e"], layouts.full_tensor("e", (4, 2)))


def test_empty_tensors_have_an_array_and_no_chunks(tmp_path):
    distckpt.save(
        {"e": ShardedTensor.from_rank_offsets("e", torch.zeros(0, 3, dtype=torch.bfloat16))},
        tmp_path,
        sharded_strategy=("zarr", 2),
    )
    assert _zarr_json(tmp_path, "e")["shape"] == [0, 3] and _chunk_files(tmp_path, "e") == []
    out = distckpt.load_plain_tensors(tmp_path)["e"]
    assert out.shape == (0, 3) and out.dtype == torch.bfloat16


# --------------------------------------------------------------------------- flattened ranges


@pytest.mark.parametrize("min_flat_chunk_bytes", [0, zs.DEFAULT_MIN_FLAT_CHUNK_BYTES])
@pytest.mark.parametrize(
    "load",
    [("flat_optimizer", 2, {"tp": 1}), ("flat_optimizer", 4, {"tp": 4}), ("flat_optimizer", 1, {"tp": 1})],
    ids=["dp2", "tp4", "whole-flat"],
)
def test_flattened_ranges_round_trip_resharded_with_one_writer_per_chunk(
    min_flat_chunk_bytes, load, tmp_path
):
    written = run_ranks(
        4,
        _save_layout,
        str(tmp_path),
        "flat_optimizer",
        {"tp": 2},
        {"min_flat_chunk_bytes": min_flat_chunk_bytes},
    )
    files = [f for w in written for f in w]
    on_disk = _chunk_files(tmp_path, "exp_avg") + _chunk_files(tmp_path, "exp_avg_bf16")
    assert len(files) == len(set(files)) and sorted(files) == sorted(on_disk)
    layout, world, params = load
    results = run_ranks(world, _load_layout, str(tmp_path), layout, params)
    assert [wrong for _, wrong, _ in results] == [[]] * world
    assert torch.equal(
        zs.ZarrLoadShardedStrategy().load(
            {"x": ShardedTensor.from_rank_offsets("exp_avg", torch.zeros(8, 6))}, tmp_path
        )["x"],
        layouts.full_tensor("exp_avg", (8, 6)),
    )


def _async_save_flat_then_mutate(ckpt):
    from distckpt.strategies.async_utils import AsyncCallsQueue

    sd, _ = layouts.build("flat_optimizer", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    queue = AsyncCallsQueue()
    request = distckpt.save(sd, ckpt, sharded_strategy=("zarr", 2), async_sharded_save=True)
    for sh in sd.values():
        sh.data.fill_(0)
    queue.schedule_async_request(request)
    queue.close()
    return check_is_distributed_checkpoint(ckpt)


def test_async_save_of_flattened_ranges_with_shared_chunks(tmp_path):
    assert run_ranks(4, _async_save_flat_then_mutate, str(tmp_path)) == [True] * 4
    results = run_ranks(2, _load_layout, str(tmp_path), "flat_optimizer", {"tp": 2, "flat": False})
    assert [wrong for _, wrong, _ in results] == [[]] * 2


def test_flattened_ranges_are_stored_in_the_original_shape(tmp_path):
    run_ranks(4, _save_layout, str(tmp_path), "flat_optimizer", {"tp": 2}, {"min_flat_chunk_bytes": 0})
    md = _zarr_json(tmp_path, "exp_avg")
    assert md["shape"] == [8, 6]
    # Cuts fall inside rows (flat 15 of each 24-element TP chunk): rows of 3 elements each.
    assert md["chunk_grid"]["configuration"]["chunk_shape"] == [1, 3]


def test_coarsened_flattened_chunks_stay_inside_their_shard(tmp_path):
    run_ranks(4, _save_layout, str(tmp_path), "flat_optimizer", {"tp": 2})
    # Tiny tensor: the chunks grow to the whole TP chunk (4 rows) and never cross into the next.
    assert _zarr_json(tmp_path, "exp_avg")["chunk_grid"]["configuration"]["chunk_shape"] == [4, 6]


def test_chunk_shape_choice():
    # Aligned pieces: the gcd grid as it is.
    assert zs.choose_chunk_shape((8, 6), (4, 0), (4, 0), 4, 1 << 20) == (4, 6)
    # Flattened cuts inside rows: grow the inner axis to the full row, then rows up to the shard.
    assert zs.choose_chunk_shape((4096, 1024), (1, 8), (2048, 0), 4, 1 << 20) == (256, 1024)
    assert zs.choose_chunk_shape((4096, 1024), (1, 8), (2048, 0), 4, 0) == (1, 8)
    # Growth picks divisors of the shard grid only.
    assert zs.choose_chunk_shape((30, 10), (1, 0), (15, 0), 1, 45) == (5, 10)


# --------------------------------------------------------------------------- resharded reads


def test_resharded_load_reads_only_overlapping_chunks(tmp_path):
    run_ranks(4, _save_layout, str(tmp_path), "grid", {"rows": 2, "cols": 2})
    # 4 column strips of the [8, 12] grid: each strip lies in one column of chunks (2 chunks).
    results = run_ranks(4, _load_layout, str(tmp_path), "grid", {"rows": 1, "cols": 4})
    assert [wrong for _, wrong, _ in results] == [[]] * 4
    for rank, (_, _, read) in enumerate(results):
        col = rank // 2
        assert read == [str(tmp_path / "grid" / "c" / f"{r}" / f"{col}") for r in (0, 1)]


def test_partial_chunk_reads_fetch_only_the_needed_bytes_without_checksums(tmp_path, monkeypatch):
    """With checks switched off (``checksums=False``, ``load(verify=False)``): a contiguous run
    is one read of its bytes; a strided region is copied out of a mapping of the span from its
    first to its last element (no reads, no temporary). By default each chunk is read whole to
    check its CRC32C (tests/untrusted/test_checksums_default.py)."""
    import mmap

    full = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path, sharded_strategy=("zarr", 2))
    read_bytes, mapped = [], []
    original_preadv, original_mmap = os.preadv, mmap.mmap

    def counting(fd, buffers, offset):
        n = original_preadv(fd, buffers, offset)
        read_bytes.append(n)
        return n

    def mapping(fd, length, *args, **kwargs):
        mapped.append((length, kwargs.get("offset", 0)))
        return original_mmap(fd, length, *args, **kwargs)

    monkeypatch.setattr(os, "preadv", counting)
    monkeypatch.setattr(mmap, "mmap", mapping)
    for sl, expected_read, expected_map in [
        ((slice(8, 16), slice(0, 64)), 8 * 64 * 4, []),  # one contiguous run
        ((slice(0, 64), slice(0, 8)), 0, [((63 * 64 + 8) * 4, 0)]),  # narrow columns
        ((slice(4, 64), slice(24, 40)), 0, [((59 * 64 + 16) * 4 + (4 * 64 + 24) * 4, 0)]),
    ]:  # a block
        read_bytes.clear()
        mapped.clear()
        piece = full[sl]
        req = ShardedTensor(
            "w",
            torch.zeros_like(piece),
            torch.float32,
            tuple(piece.shape),
            (64, 64),
            (sl[0].start, sl[1].start),
            None,
            0,
        )
        out = zs.ZarrLoadShardedStrategy(checksums=False).load({"w": req}, tmp_path)["w"]
        assert torch.equal(out, piece)
        assert sum(read_bytes) == expected_read
        assert mapped == expected_map


# --------------------------------------------------------------------------- data types


DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _random_bits(key, shape, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _save_dtype(ckpt, dtype, engine):
    rank = ddist.get_rank()
    full = _random_bits(str(dtype), (6, 5), dtype)
    local = full[rank * 3 : (rank + 1) * 3].clone()
    sh = ShardedTensor.from_rank_offsets("t", local, (0, rank, 2))
    scalar = ShardedTensor.from_rank_offsets("s", full[0, 0].clone(), replica_id=rank)
    distckpt.save({"t": sh, "s": scalar}, ckpt, sharded_strategy=zs.ZarrSaveShardedStrategy(io_engine=engine))


@pytest.mark.parametrize("engine", ["raw", "tensorstore"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_dtype_round_trips_bit_exactly(dtype, engine, tmp_path):
    run_ranks(2, _save_dtype, str(tmp_path), dtype, engine)
    full = _random_bits(str(dtype), (6, 5), dtype)
    out = zs.ZarrLoadShardedStrategy(io_engine=engine).load(
        {
            "t": ShardedTensor.from_rank_offsets("t", torch.zeros(6, 5, dtype=dtype)),
            "s": ShardedTensor.from_rank_offsets("s", torch.zeros((), dtype=dtype)),
        },
        tmp_path,
    )
    assert out["t"].dtype == dtype and torch.equal(_bits(out["t"]), _bits(full))
    assert torch.equal(_bits(out["s"]), _bits(full[0, 0]))
    assert distckpt.load_tensors_metadata(tmp_path)["t"].dtype == dtype


def test_load_casts_to_the_requested_dtype(tmp_path):
    full = torch.randn(4, 4).to(torch.bfloat16)
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path, sharded_strategy=("zarr", 2))
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, tmp_path)
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], full.float())


def test_unsupported_dtype_is_a_clear_error(tmp_path):
    t = torch.zeros(2, dtype=torch.complex32)
    with pytest.raises(CheckpointingException, match=r"'c'.*complex32 cannot be stored by the zarr backend"):
        distckpt.save({"c": ShardedTensor.from_rank_offsets("c", t)}, tmp_path, sharded_strategy=("zarr", 2))


# --------------------------------------------------------------------------- other readers


def test_zarr_python_alone_reads_the_global_tensors(tmp_path):
    import zarr

    run_ranks(4, _save_layout, str(tmp_path), "tp_dp", {"tp": 2})
    assert zs.register_zarr_python_dtypes()
    group = zarr.open_group(str(tmp_path), mode="r")
    expected = {p.key: p for p in layouts.tp_dp(0, 1, 1)}
    assert sorted(group.array_keys()) == sorted(expected)
    for key, piece in expected.items():
        arr = zarr.open_array(str(tmp_path / key), mode="r")[...]
        want = layouts.full_tensor(key, piece.global_shape, piece.dtype)
        got = (
            torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            .view(piece.dtype)
            .reshape(arr.shape)
        )
        assert torch.equal(_bits(got), _bits(want)), key


def test_tensorstore_alone_reads_the_global_tensors(tmp_path):
    import tensorstore as ts

    run_ranks(4, _save_layout, str(tmp_path), "grid", {"rows": 2, "cols": 2})
    store = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "grid")}}
    ).result()
    assert torch.equal(torch.from_numpy(store.read().result()), layouts.full_tensor("grid", (8, 12)))


def test_nested_keys_become_zarr_groups(tmp_path):
    import zarr

    full = torch.arange(6.0)
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("decoder/layer0/w", full)},
        tmp_path,
        sharded_strategy=("zarr", 2),
    )
    assert torch.equal(
        torch.from_numpy(zarr.open_group(str(tmp_path), mode="r")["decoder"]["layer0"]["w"][...]), full
    )
    assert set(distckpt.load_tensors_metadata(tmp_path)) == {"decoder/layer0/w"}


def _save_clashing_keys(ckpt):
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), replica_id=ddist.get_rank()),
        "ab": ShardedTensor.from_rank_offsets("a/b", torch.zeros(2), replica_id=ddist.get_rank()),
    }
    distckpt.save(sd, ckpt, sharded_strategy=("zarr", 2))


def test_keys_whose_folders_would_nest_fail_on_every_rank(tmp_path):
    expect_all_ranks_raise(
        2, _save_clashing_keys, str(tmp_path), match=r"'a' and 'a/b' cannot both be stored"
    )
    assert not check_is_distributed_checkpoint(tmp_path)


# --------------------------------------------------------------------------- compression, engines


def test_compressed_checkpoint_round_trips_and_reads_with_zarr_python(tmp_path):
    import zarr

    written = run_ranks(2, _save_layout, str(tmp_path), "tp_dp", {"tp": 2}, {"compression": "zstd"})
    assert written == [[], []]  # all chunks went through tensorstore
    assert _zarr_json(tmp_path, "col")["codecs"][1]["name"] == "zstd"
    results = run_ranks(4, _load_layout, str(tmp_path), "tp_dp", {"tp": 4})
    assert [wrong for _, wrong, _ in results] == [[]] * 4
    assert torch.equal(
        torch.from_numpy(zarr.open_array(str(tmp_path / "row"), mode="r")[...]),
        layouts.full_tensor("row", (6, 8)),
    )


def test_tensorstore_engine_round_trips_resharded(tmp_path):
    run_ranks(
        4, _save_layout, str(tmp_path), "stacked", {"pp": 2, "per_layer": True}, {"io_engine": "tensorstore"}
    )
    results = run_ranks(
        2, _load_layout, str(tmp_path), "stacked", {"pp": 2, "per_layer": False}, {"io_engine": "tensorstore"}
    )
    assert [wrong for _, wrong, _ in results] == [[]] * 2


def test_raw_engine_refuses_compressed_arrays(tmp_path):
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))},
        tmp_path,
        sharded_strategy=zs.ZarrSaveShardedStrategy(compression="gzip"),
    )
    with pytest.raises(CheckpointingException, match=r"'w'.*io_engine='raw' cannot read"):
        zs.ZarrLoadShardedStrategy(io_engine="raw").load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3))}, tmp_path
        )


# --------------------------------------------------------------------------- legacy Megatron-Core zarr


def _legacy_expected():
    return torch.load(LEGACY / "expected.pt", weights_only=True)


def _load_legacy(ckpt, split_axis):
    """Every rank loads its piece of every tensor, cut along ``split_axis`` (-1: last axis;
    None: whole), plus every object and the common state."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    expected = _legacy_expected()
    sd, want = {}, {}
    for key, t in expected["tensors"].items():
        if split_axis is None:
            sd[key] = ShardedTensor.from_rank_offsets(key, torch.zeros_like(t), replica_id=rank)
            want[key] = t
            continue
        axis = split_axis % t.dim()
        off, length = splits(t.shape[axis], world)[rank]
        local = t.narrow(axis, off, length).clone()
        goff = [0] * t.dim()
        goff[axis] = off
        sd[key] = ShardedTensor(
            key, torch.zeros_like(local), t.dtype, tuple(local.shape), tuple(t.shape), tuple(goff), None, 0
        )
        want[key] = local
    for uk in expected["objects"]:
        sd[uk] = ShardedObject.empty_from_unique_key(uk, replica_id=rank)
    loaded = distckpt.load(sd, ckpt)
    wrong = [k for k, w in want.items() if loaded[k].dtype != w.dtype or not torch.equal(loaded[k], w)]
    wrong += [uk for uk, obj in expected["objects"].items() if repr(loaded[uk]) != repr(obj)]
    common = {k: v for k, v in loaded.items() if k not in sd}
    return wrong, common == expected["common"]


@pytest.mark.parametrize(
    "world,split_axis",
    [(1, None), (4, -1), (4, 0), (2, -1)],
    ids=["whole-w1", "axes-swapped-w4", "rows-w4", "axes-swapped-w2"],
)
def test_legacy_megatron_zarr_checkpoint_loads_bit_exactly(world, split_axis):
    assert json.loads((LEGACY / "ckpt" / "metadata.json").read_text())["sharded_backend_version"] == 1
    assert run_ranks(world, _load_legacy, str(LEGACY / "ckpt"), split_axis) == [([], True)] * world


def test_legacy_metadata_queries_and_lock_folders(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(LEGACY / "ckpt", ckpt)
    (ckpt / "weight_row.sync").mkdir()
    (ckpt / "weight_row.sync" / ".zarray").write_text("{}")
    expected = _legacy_expected()
    meta = distckpt.load_tensors_metadata(ckpt)
    assert {k: (tuple(v.global_shape), v.dtype) for k, v in meta.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in expected["tensors"].items()
    }
    plain = distckpt.load_plain_tensors(ckpt)
    assert all(torch.equal(plain[k], v) for k, v in expected["tensors"].items())
    assert set(distckpt.load_sharded_metadata(ckpt)) == set(expected["tensors"]) | set(expected["objects"])


# --------------------------------------------------------------------------- errors


def _load_grid_whole(ckpt):
    sd = {"g": ShardedTensor.from_rank_offsets("grid", torch.zeros(8, 12), replica_id=ddist.get_rank())}
    distckpt.load(sd, ckpt)


@pytest.mark.parametrize(
    "damage,match",
    [
        ("delete_chunk", r"key 'grid': chunk file .*grid/c/1/0 \(rank \d\) is missing"),
        ("truncate_chunk", r"key 'grid': chunk file .*grid/c/1/0 \(rank \d\) holds 10 bytes, expected 96"),
        ("corrupt_metadata", r"grid/zarr.json: unreadable Zarr metadata of key 'grid'"),
        ("delete_array", r"ShardedTensor 'grid' is not in checkpoint"),
    ],
)
def test_damaged_checkpoint_fails_on_every_rank_naming_key_and_file(damage, match, tmp_path):
    run_ranks(4, _save_layout, str(tmp_path), "grid", {"rows": 2, "cols": 2})
    chunk = tmp_path / "grid" / "c" / "1" / "0"
    if damage == "delete_chunk":
        chunk.unlink()
    elif damage == "truncate_chunk":
        chunk.write_bytes(chunk.read_bytes()[:10])
    elif damage == "corrupt_metadata":
        (tmp_path / "grid" / "zarr.json").write_text("{not json")
    else:
        shutil.rmtree(tmp_path / "grid")
    expect_all_ranks_raise(2, _load_grid_whole, str(tmp_path), match=match)


def test_truncated_chunk_read_through_tensorstore_is_a_clear_error(tmp_path):
    run_ranks(2, _save_layout, str(tmp_path), "grid", {"rows": 2, "cols": 1}, {"compression": "zstd"})
    chunk = tmp_path / "grid" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:5])
    # By default the chunk's CRC32C catches it; without checks, tensorstore's own error is worded.
    with pytest.raises(
        CheckpointingException, match=r"key 'grid': chunk file .*grid/c/1/0 .*CRC32C mismatch"
    ):
        distckpt.load_plain_tensors(tmp_path)
    with pytest.raises(
        CheckpointingException, match=r"grid/c/1/0: key 'grid': reading chunk \[1, 0\] failed"
    ):
        distckpt.load_plain_tensors(tmp_path, sharded_strategy=zs.ZarrLoadShardedStrategy(checksums=False))


def _save_failing_on_rank1(ckpt):
    sd, _ = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    original = zs.RawIO.write

    def failing(self, jobs):
        if ddist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return original(self, jobs)

    zs.RawIO.write = failing
    try:
        distckpt.save(sd, ckpt, sharded_strategy=("zarr", 2))
    finally:
        zs.RawIO.write = original


def test_write_failure_on_one_rank_fails_every_rank_and_commits_nothing(tmp_path):
    expect_all_ranks_raise(2, _save_failing_on_rank1, str(tmp_path), match=r"disk full \(injected\)")
    assert not check_is_distributed_checkpoint(tmp_path)


# --------------------------------------------------------------------------- shapes, surgery


def test_allow_shape_mismatch_loads_the_overlap_and_zeroes_the_rest(tmp_path):
    full = torch.arange(12.0).reshape(3, 4)
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path, sharded_strategy=("zarr", 2))
    bigger = ShardedTensor.from_rank_offsets("w", torch.full((4, 4), 7.0), allow_shape_mismatch=True)
    out = distckpt.load({"w": bigger}, tmp_path)["w"]
    assert torch.equal(out[:3], full) and torch.equal(out[3], torch.zeros(4))
    with pytest.raises(CheckpointingException, match=r"'w': global shape \[4, 4\] was requested"):
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, tmp_path)


def test_remove_sharded_tensors_drops_the_arrays(tmp_path):
    run_ranks(2, _save_layout, str(tmp_path), "tp_dp", {"tp": 2})
    distckpt.remove_sharded_tensors(tmp_path, "c")
    assert set(distckpt.load_tensors_metadata(tmp_path)) == {"row", "emb", "half", "bias", "mask", "steps"}
    assert not (tmp_path / "col").exists() and not (tmp_path / "count").exists()
    assert verify_files(tmp_path, read_manifest(tmp_path)) == []


# --------------------------------------------------------------------------- integrity manifest


@pytest.mark.parametrize("engine", ["raw", "tensorstore"])
def test_manifest_covers_every_file_and_verify_catches_a_flipped_byte(engine, tmp_path):
    run_ranks(2, _save_layout, str(tmp_path), "grid", {"rows": 2, "cols": 1})
    manifest = read_manifest(tmp_path)
    assert verify_files(tmp_path, manifest) == []
    assert {"zarr.json", "grid/zarr.json", "grid/c/0/0", "grid/c/1/0", "common.pt"} <= set(manifest.files)
    chunk = tmp_path / "grid" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert any("grid/c/1/0" in p and "CRC32C mismatch" in p for p in verify_files(tmp_path, manifest))

    def request():
        return {"g": ShardedTensor.from_rank_offsets("grid", torch.zeros(8, 12))}

    strategy = zs.ZarrLoadShardedStrategy(io_engine=engine)
    assert not torch.equal(
        distckpt.load(request(), tmp_path, sharded_strategy=strategy, verify=False)["g"],
        layouts.full_tensor("grid", (8, 12)),
    )  # only the explicit opt-out loads it
    for verify in (None, True):
        with pytest.raises(
            CheckpointingException, match=r"grid/c/1/0 \(rank 0\): CRC32C mismatch against the manifest"
        ):
            distckpt.load(
                request(),
                tmp_path,
                sharded_strategy=zs.ZarrLoadShardedStrategy(io_engine=engine),
                verify=verify,
            )
