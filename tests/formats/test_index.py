"""The sidecar index ``.distckpt_index``: written at commit, read partially at load, checked."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor
from distckpt import dist as ddist
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_read import IndexReader
from distckpt.formats.index_write import build_index
from distckpt.formats.manifest import read_manifest, verify_files
from distckpt.storage import open_store
from distckpt.strategies.torch import TorchDistLoadShardedStrategy
from tests.support import faults, layouts
from tests.support.clouds import clouds
from tests.support.harness import run_ranks

N_KEYS = 200


def _many_keys(with_data: bool) -> dict:
    sd = {}
    for i in range(N_KEYS):
        t = torch.arange(16, dtype=torch.float32) + i if with_data else torch.empty(16)
        sd[f"k{i}"] = ShardedTensor.from_rank_offsets(f"k{i}", t)
    sd["obj"] = ShardedObject("obj", {"a": 1} if with_data else None, (1,), (0,))
    return sd


@pytest.fixture
def many(tmp_path):
    distckpt.save(_many_keys(True), tmp_path)
    return tmp_path


def _load_some(location, keys, **kwargs):
    strategy = TorchDistLoadShardedStrategy(**kwargs)
    sd = {k: v for k, v in _many_keys(False).items() if k in keys}
    out = distckpt.load(sd, location, sharded_strategy=strategy)
    return out, strategy


def test_sidecar_is_written_beside_metadata_and_covered_by_the_manifest(many):
    assert (many / INDEX_FNAME).is_file() and (many / ".metadata").is_file()
    manifest = read_manifest(many)
    assert INDEX_FNAME in manifest.files
    assert verify_files(many, manifest) == []


def test_load_reads_only_the_requested_keys_records_and_not_metadata(many):
    # Garbage of the same length in .metadata: a load that unpickled it would fail.
    size = (many / ".metadata").stat().st_size
    (many / ".metadata").write_bytes(b"\0" * size)
    out, strategy = _load_some(many, {"k7", "obj"})
    assert strategy.last_load_used_index
    assert torch.equal(out["k7"], torch.arange(16, dtype=torch.float32) + 7) and out["obj"] == {"a": 1}
    total = (many / INDEX_FNAME).stat().st_size
    # The directory names every key; records of 1 of 200 keys are a small part of the rest.
    reader = IndexReader.open(many)
    directory = reader.data_start
    assert 0 < strategy.index_node_bytes_read < (total - directory) / 20, (
        strategy.index_node_bytes_read,
        total,
    )
    assert strategy.index_bytes_read < total


def test_metadata_queries_and_the_tools_answer_from_the_sidecar_directory_not_metadata(many):
    # Garbage of the same length in .metadata: a query that unpickled it would fail. At scale
    # .metadata holds every chunk of every key (hundreds of MB) and every rank would read it.
    size = (many / ".metadata").stat().st_size
    (many / ".metadata").write_bytes(b"\0" * size)
    metas = distckpt.load_tensors_metadata(many)
    assert len(metas) == N_KEYS and metas["k7"].global_shape == (16,) and metas["k7"].dtype == torch.float32
    assert "obj/shard_0_1" in distckpt.load_sharded_metadata(many)
    from distckpt.tools.sources.checkpoint import CheckpointSource

    src = CheckpointSource(many)
    assert src.meta("k3").chunks == 1 and src.meta("k3").disk_bytes > 64
    assert torch.equal(src.read("k3", (4,), (2,)), torch.tensor([7.0, 8.0]))


def test_a_load_opens_the_sidecar_once(many, monkeypatch):
    opened = []
    real = IndexReader.open.__func__

    def counting(cls, location, *args, **kwargs):
        opened.append(location)
        return real(cls, location, *args, **kwargs)

    monkeypatch.setattr(IndexReader, "open", classmethod(counting))
    out, strategy = _load_some(many, {"k3", "obj"})
    assert strategy.last_load_used_index and torch.equal(out["k3"], torch.arange(16, dtype=torch.float32) + 3)
    assert len(opened) == 1  # the common items' look at the directory and the load share one reader


def test_a_reader_kept_for_the_next_load_is_not_used_once_the_checkpoint_was_replaced(tmp_path):
    """``load_common_items`` keeps its sidecar reader for the load that follows; if another save
    replaced the checkpoint in between, the load opens the new sidecar instead."""
    distckpt.save(_many_keys(True), tmp_path)
    strategy = TorchDistLoadShardedStrategy()
    assert strategy.load_common_items(tmp_path) == {}
    moved = {f"k{i}": ShardedTensor.from_rank_offsets(f"k{i}", torch.full((16,), -1.0 - i)) for i in range(3)}
    distckpt.save(moved, tmp_path)  # another layout of the files: k1's record is elsewhere now
    out = strategy.load({"k1": ShardedTensor.from_rank_offsets("k1", torch.empty(16))}, tmp_path)
    assert torch.equal(out["k1"], torch.full((16,), -2.0))


def test_close_sidecar_ranges_are_read_together_and_cut_apart(tmp_path, monkeypatch):
    from distckpt.formats import index_read as ix

    data = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / INDEX_FNAME).write_bytes(data)
    monkeypatch.setattr(ix, "_GAP", 100)
    starts, lengths = [5000, 10, 150, 60, 9000], [20, 40, 7, 30, 0]  # unsorted; 10, 60 and 150 close
    reads = []
    real_open = open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        real_read = f.read

        def read(n=-1):
            reads.append(n)
            return real_read(n)

        f.read = read
        return f

    monkeypatch.setattr("builtins.open", counting_open)
    views, fetched = ix._read_ranges(tmp_path, starts, lengths, "where")
    assert [bytes(v) for v in views] == [data[a : a + n] for a, n in zip(starts, lengths)]
    assert reads == [147, 20, 0]  # [10, 157) in one read, then 5000 and 9000
    assert fetched == sum(reads)


def test_a_rank_reads_the_records_of_its_share_not_of_the_world(tmp_path):
    """One key of 4096 chunks; a load of one chunk touches a few tree nodes, not all records."""
    keys = {"w": {"dtype": torch.float32, "size": (4096, 8), "orig_shape": None}}
    records = [("w", (i, 0), (1, 8), f"__{i}_0.distcp", 0, 100, 0) for i in range(4096)]
    (tmp_path / ".metadata").write_bytes(b"x" * 10)
    data = build_index(keys, records, 10)
    (tmp_path / INDEX_FNAME).write_bytes(data)
    reader = IndexReader.open(tmp_path)
    found = reader.query({"w": [((1234, 0), (2, 8))]})
    assert [r[0] for r in found["w"]] == [(1234, 0), (1235, 0)]
    assert [r[2] for r in found["w"]] == ["__1234_0.distcp", "__1235_0.distcp"]
    assert reader.bytes_read < len(data) / 10, (reader.bytes_read, len(data))


@pytest.mark.parametrize("boxes", [1, 2, 3, 4, 5, 9])
def test_query_returns_exactly_the_chunks_that_meet_any_box(tmp_path, boxes):
    """Small leaves with up to four boxes are searched in Python, the rest with numpy; both must
    find every chunk that meets any box and nothing else, against a brute-force intersection."""
    import random

    rng = random.Random(boxes)
    keys, records = {}, []
    for k in range(12):
        rows, cols = rng.choice([(4, 1), (3, 5), (8, 2), (40, 3)])
        size = (rows * 4, cols * 6)
        keys[f"k{k}"] = {"dtype": torch.float32, "size": size, "orig_shape": None}
        for i in range(rows):
            for j in range(cols):
                records.append(
                    (f"k{k}", (4 * i, 6 * j), (4, 6), f"__{k}_{i}.distcp", 64 * j, 96, i * 100 + j)
                )
    (tmp_path / ".metadata").write_bytes(b"x" * 10)
    (tmp_path / INDEX_FNAME).write_bytes(build_index(keys, records, 10))
    query = {}
    for fqn, e in keys.items():
        query[fqn] = []
        for _ in range(boxes):
            lo = tuple(rng.randrange(n) for n in e["size"])
            query[fqn].append((lo, tuple(rng.randint(1, n - a) for a, n in zip(lo, e["size"]))))
    found = IndexReader.open(tmp_path).query(query)

    def meets(off, size, box):
        return all(o < bo + bs and o + s > bo for o, s, bo, bs in zip(off, size, *box))

    for fqn, bxs in query.items():
        expected = sorted(
            (r[1], r[2]) for r in records if r[0] == fqn and any(meets(r[1], r[2], b) for b in bxs)
        )
        assert sorted((tuple(r[0]), tuple(r[1])) for r in found[fqn]) == expected, fqn
        assert all(r[5] == int(r[0][0]) // 4 * 100 + int(r[0][1]) // 6 for r in found[fqn])


@pytest.mark.parametrize("ndim", [0, 1, 3])
def test_query_of_other_axis_counts_and_numpy_coordinates_matches_brute_force(tmp_path, ndim):
    """The plain-Python search of small leaves for keys of 0, 1 and 3 axes, with request
    coordinates given as numpy integers (as a caller's arithmetic may leave them): a 0-d key's one
    chunk meets its empty box; the others find exactly the chunks that meet a box."""
    import itertools

    size = {0: (), 1: (4,), 3: (2, 3, 2)}[ndim]
    chunk = {0: (), 1: (2,), 3: (2, 1, 1)}[ndim]
    keys = {"k": {"dtype": torch.float32, "size": size, "orig_shape": None}}
    starts = list(itertools.product(*(range(0, s, c) for s, c in zip(size, chunk))))
    records = [("k", off, chunk, "__0_0.distcp", 64 * i, 64, i) for i, off in enumerate(starts)]
    (tmp_path / ".metadata").write_bytes(b"x" * 10)
    (tmp_path / INDEX_FNAME).write_bytes(build_index(keys, records, 10))
    boxes = [
        (tuple(np.int64(0) for _ in size), tuple(np.int64(1) for _ in size)),
        (tuple(np.int64(s - 1) for s in size), tuple(np.int64(1) for _ in size)),
    ]
    found = IndexReader.open(tmp_path).query({"k": boxes})["k"]

    def meets(off, box):
        return all(o < bo + bs and o + c > bo for o, c, bo, bs in zip(off, chunk, *box))

    expected = [off for off in starts if any(meets(off, b) for b in boxes)]
    assert sorted(tuple(r[0]) for r in found) == sorted(expected)
    assert len(expected) == (1 if ndim == 0 else 2)
    assert all(isinstance(r[0], tuple) and isinstance(r[1], tuple) for r in found)


@pytest.mark.parametrize(
    "record, match",
    [
        (
            ("w", (4,), (4,), "../outside.distcp", 0, 100, 0),
            r"key 'w': file name '\.\./outside\.distcp' points outside",
        ),
        (("w", (4,), (4,), "__0_0.distcp", -1, 100, 0), r"key 'w': offset -1 is not an integer"),
        (
            ("w", (4,), (4,), "__0_0.distcp", 0, 1 << 60, 0),
            r"key 'w': length 1152921504606846976 is not an integer",
        ),
        (
            ("w", (4,), (1 << 50,), "__0_0.distcp", 0, 100, 0),
            r"key 'w': chunk size 1125899906842624 is not an integer",
        ),
        (
            ("w", (4,), (4,), "__0_0.distcp", 0, 8, 0),
            r"key 'w': chunk at \[4\] of \[4\] elements needs 16 bytes",
        ),
    ],
)
def test_a_sidecar_record_with_a_hostile_claim_is_refused_naming_the_key(tmp_path, record, match):
    """A sidecar that passes its CRC32Cs (built, not corrupted) but claims a file outside the
    checkpoint, an impossible offset, length or shape: refused before any read, also when an
    earlier record of the same load was fine (each file name and number is checked)."""
    from distckpt.strategies.torch import _index_from_sidecar

    keys = {"w": {"dtype": torch.float32, "size": (8,), "orig_shape": None}}
    good = ("w", (0,), (4,), "__0_0.distcp", 0, 100, 0)
    (tmp_path / ".metadata").write_bytes(b"x" * 10)
    (tmp_path / INDEX_FNAME).write_bytes(build_index(keys, [good, record], 10))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}
    with pytest.raises(CheckpointingException, match=r"\.distckpt_index: " + match):
        _index_from_sidecar(IndexReader.open(tmp_path), request, None)


def test_without_sidecar_the_load_falls_back_to_metadata(many):
    (many / INDEX_FNAME).unlink()
    out, strategy = _load_some(many, {"k3"})
    assert not strategy.last_load_used_index
    assert torch.equal(out["k3"], torch.arange(16, dtype=torch.float32) + 3)


def test_stale_sidecar_is_ignored(many):
    """A tool that rewrote .metadata without knowing the sidecar: the length no longer matches."""
    with open(many / ".metadata", "ab") as f:
        f.write(b"\0")
    assert IndexReader.open(many) is None


@pytest.mark.parametrize("where", ["header", "directory", "node"])
def test_corrupted_sidecar_is_detected_naming_the_file(many, where):
    path = many / INDEX_FNAME
    (n,) = struct.unpack_from("<Q", path.read_bytes(), 8)
    offset = {"header": 0, "directory": 20 + n // 2, "node": 20 + n + 30}[where]
    faults.flip_byte(path, offset)
    with pytest.raises(CheckpointingException, match=r"\.distckpt_index.*corrupted"):
        _load_some(many, {f"k{i}" for i in range(N_KEYS)})
    assert any(INDEX_FNAME in p for p in verify_files(many, read_manifest(many)))


def _save_flat(ckpt):
    sd, _ = layouts.build("flat_optimizer", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    tp, _ = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    sd.update({f"m.{k}": v for k, v in tp.items()})
    distckpt.save(sd, ckpt)


def _load_flat(ckpt, tp, use_index):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd, pieces = layouts.build("flat_optimizer", rank, world, False, tp=tp)
    m, mpieces = layouts.build("tp_dp", rank, world, False, tp=tp)
    sd.update({f"m.{k}": v for k, v in m.items()})
    pieces.update({f"m.{k}": v for k, v in mpieces.items()})
    strategy = TorchDistLoadShardedStrategy(use_index=use_index)
    out = distckpt.load(sd, ckpt, sharded_strategy=strategy)
    wrong = [n for n, p in pieces.items() if not layouts.bitwise_equal(out[n], p.expected())]
    return wrong, strategy.last_load_used_index, strategy.bytes_read


@pytest.mark.parametrize("tp", [2, 1])
def test_sidecar_loads_match_metadata_loads_across_layouts(tmp_path, tp):
    run_ranks(4, _save_flat, str(tmp_path))
    with_index = run_ranks(2, _load_flat, str(tmp_path), tp, True)
    without = run_ranks(2, _load_flat, str(tmp_path), tp, False)
    assert [(w, used) for w, used, _ in with_index] == [([], True)] * 2
    assert [(w, used) for w, used, _ in without] == [([], False)] * 2
    assert [b for *_, b in with_index] == [b for *_, b in without]  # the same data bytes read


def test_remove_sharded_tensors_rebuilds_the_sidecar(many):
    distckpt.remove_sharded_tensors(many, "k1")  # k1, k10..k19, k100..k199
    reader = IndexReader.open(many)
    assert reader is not None and "k1" not in reader.keys and "k2" in reader.keys
    out, strategy = _load_some(many, {"k2"})
    assert strategy.last_load_used_index and torch.equal(out["k2"], torch.arange(16, dtype=torch.float32) + 2)
    assert verify_files(many, read_manifest(many)) == []


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_sidecar_on_an_object_store_is_read_with_ranged_reads(many, cloud_url):
    store = open_store(cloud_url)
    for p in many.iterdir():
        store.put(p.name, p.read_bytes())
    out, strategy = _load_some(cloud_url, {"k5"})
    assert strategy.last_load_used_index
    assert torch.equal(out["k5"], torch.arange(16, dtype=torch.float32) + 5)
    assert strategy.index_bytes_read < store.size(INDEX_FNAME)
    # An item whose bytes changed fails the CRC32C from the sidecar's record (no manifest read).
    fname, item = next((f, r) for f, rs in read_manifest(many).ranges.items() for r in rs if r.key == "k5")
    raw = bytearray(store.get(fname))
    raw[item.offset + item.length - 30] ^= 0x40
    store.put(fname, bytes(raw))
    with pytest.raises(CheckpointingException, match="k5.*CRC32C"):
        _load_some(cloud_url, {"k5"})


def test_sidecar_directory_is_json_with_the_documented_fields(many):
    raw = (many / INDEX_FNAME).read_bytes()
    magic, n, _ = struct.unpack_from("<8sQI", raw)
    directory = json.loads(raw[20 : 20 + n])
    assert magic == b"DCKIDX01" and directory["format"] == "distckpt-index"
    assert (
        directory["keys"]["k0"]["dtype"] == "float32" and directory["keys"]["obj/shard_0_1"]["bytes"] is True
    )


def test_megatron_fixtures_have_no_sidecar_so_their_loads_take_the_fallback(tmp_path):
    """tests/interop/test_megatron_fixtures.py loads them bit-exactly: through .metadata."""
    from tests.interop.test_megatron_fixtures import DATA

    ckpts = sorted(p for p in DATA.glob("*/*/ckpt") if (p / ".metadata").is_file())
    assert ckpts and not any((p / INDEX_FNAME).exists() for p in ckpts)
    shutil.copytree(ckpts[0], tmp_path / "ckpt")
    meta = distckpt.load_tensors_metadata(tmp_path / "ckpt")
    sd = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty(v.global_shape, dtype=v.dtype))
        for k, v in meta.items()
    }
    strategy = TorchDistLoadShardedStrategy()
    out = distckpt.load(sd, tmp_path / "ckpt", sharded_strategy=strategy)
    assert not strategy.last_load_used_index and set(out) >= set(meta)


def _random_rows(rng, n, ndim, nfiles):
    import numpy as np

    rows = np.zeros((n, 2 * ndim + 4), dtype=np.int64)
    if ndim:
        rows[:, :ndim] = rng.integers(0, 1000, (n, ndim))
        rows[:, ndim : 2 * ndim] = rng.integers(1, 50, (n, ndim))
    rows[:, 2 * ndim] = rng.integers(0, nfiles, n)
    rows[:, 2 * ndim + 1 : 2 * ndim + 3] = rng.integers(0, 1 << 40, (n, 2))
    rows[:, -1] = rng.integers(0, 1 << 32, n)
    return rows


@pytest.mark.parametrize("fanout,leaf", [(64, 16), (3, 2)])
def test_a_sidecar_template_patched_with_new_crcs_is_the_sidecar_built_anew(fanout, leaf):
    """The template kept for ``cached_metadata`` saves: the same records with other CRC32Cs give
    byte for byte the sidecar a fresh build gives (small keys, deep trees, byte items, 0-d keys,
    keys without records), again and again; records that do not fit it are declined."""
    import numpy as np

    from distckpt.formats.index_write import build_index_from_rows

    rng = np.random.default_rng(7)
    names = [f"__{r}_0.distcp" for r in range(9)] + ['odd "name".distcp']
    keys, rows = {}, {}
    for i, (n, ndim) in enumerate([(1, 2), (5, 1), (16, 3), (17, 2), (200, 2), (1000, 1), (3, 0), (0, 2)]):
        keys[f"t{i}"] = {
            "dtype": torch.bfloat16,
            "size": (4096,) * ndim,
            "orig_shape": (7,) if i == 2 else None,
        }
        rows[f"t{i}"] = _random_rows(rng, n, ndim, len(names))
    for i in range(3):
        keys[f"obj{i}"] = {"bytes": True}
        rows[f"obj{i}"] = _random_rows(rng, 1 + i, 0, len(names))
    keys["obj_without_bytes"] = {"bytes": True}
    first, template = build_index_from_rows(keys, rows, names, 1234, fanout, leaf, template=True)
    assert first == build_index_from_rows(keys, rows, names, 1234, fanout, leaf)
    for round_ in range(3):
        for r in rows.values():
            r[:, -1] = rng.integers(0, 1 << 32, len(r))
        crcs = {fqn: r[:, -1] for fqn, r in rows.items() if len(r)}
        patched = template.patch(crcs, 1234 + round_)
        assert patched == build_index_from_rows(keys, rows, names, 1234 + round_, fanout, leaf), round_
    assert template.patch({**crcs, "t4": crcs["t4"][:-1]}, 1) is None  # a record fewer
    assert template.patch({fqn: v for fqn, v in crcs.items() if fqn != "obj1"}, 1) is None


def _save_constant_structure(base, saves):
    """``saves`` saves of one structure with new values, through one ``cached_metadata``
    strategy into ``ckpt<i>``, and each also through a fresh strategy into ``fres<i>`` (a path
    of the same length, so that ``.metadata`` has the same length too)."""
    from distckpt.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    templates = []
    for i in range(saves):
        # Every value depends on the generation, no key does: new CRC32Cs, the same structure.
        sd = faults.generation_state(ddist.get_rank(), ddist.get_world_size(), i + 1)
        distckpt.save(sd, f"{base}/ckpt{i}", sharded_strategy=strategy)
        templates.append(id(strategy._index_template))
        sd = faults.generation_state(ddist.get_rank(), ddist.get_world_size(), i + 1)
        distckpt.save(sd, f"{base}/fres{i}", sharded_strategy=TorchDistSaveShardedStrategy())
    return templates


def _load_generation(ckpt, generation):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    reader = TorchDistLoadShardedStrategy()
    out = distckpt.load(
        faults.generation_state(rank, world, generation, with_data=False),
        ckpt,
        sharded_strategy=reader,
        verify=True,
    )
    return reader.index_bytes_read > 0, faults.generation_mismatches(out, rank, world, generation)


def test_saves_of_an_unchanged_structure_patch_the_last_sidecar(tmp_path):
    templates = run_ranks(2, _save_constant_structure, str(tmp_path), 3)
    assert len(set(templates[0])) == 1 and templates[0][0] != id(None)  # built once, then patched
    for i in range(3):
        ckpt = tmp_path / f"ckpt{i}"
        assert verify_files(ckpt, read_manifest(ckpt)) == [], i
        assert run_ranks(2, _load_generation, str(ckpt), i + 1) == [(True, [])] * 2, i
        # The patched sidecar is byte for byte the one a save without the cache builds.
        assert (ckpt / INDEX_FNAME).read_bytes() == (tmp_path / f"fres{i}" / INDEX_FNAME).read_bytes(), i


def test_coalesce_merges_close_ranges_up_to_a_span():
    from distckpt.storage import coalesce

    ranges = [(0, 10), (15, 5), (100, 10), (112, 8)]
    assert coalesce(ranges, gap=5) == ([(0, 20), (100, 20)], [(0, 0, 10), (0, 15, 5), (1, 0, 10), (1, 12, 8)])
    # a request may not grow past max_span: the last range starts a request of its own
    assert coalesce(ranges, gap=5, max_span=15)[0] == [(0, 10), (15, 5), (100, 10), (112, 8)]
    assert coalesce(ranges, gap=5, max_span=20)[0] == [(0, 20), (100, 20)]


@pytest.mark.parametrize("claim", [b'"float99"', b"123456789"])
def test_a_sidecar_naming_an_unknown_dtype_is_an_error_naming_the_key(many, claim):
    """The directory's CRC32C is recomputed, as a crafted sidecar would: the load still refuses
    the key's dtype (an unknown name, or not a name at all) with an error naming key and file."""
    from distckpt.formats.manifest import crc32c

    raw = bytearray((many / INDEX_FNAME).read_bytes())
    magic, n, _ = struct.unpack_from("<8sQI", raw)
    directory = bytes(raw[20 : 20 + n])
    spot = directory.index(b'"k5":{')
    at = directory.index(b'"float32"', spot)
    directory = directory[:at] + claim + directory[at + len(b'"float32"') :]
    assert len(directory) == n
    raw[20 : 20 + n] = directory
    struct.pack_into("<8sQI", raw, 0, magic, n, crc32c(directory))
    (many / INDEX_FNAME).write_bytes(bytes(raw))
    with pytest.raises(CheckpointingException, match=r"\.distckpt_index.*key 'k5'"):
        _load_some(many, {"k5"})
