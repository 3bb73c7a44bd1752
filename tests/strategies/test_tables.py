"""The compact per-rank payloads of a save: ShardTable (validation) and RecordTable (commit).

Rank 0 validates every rank's ShardTable with numpy and writes ``.metadata`` straight from the
RecordTables' arrays; these tests check both against the plain definitions (single process:
the gathers themselves are covered by the multi-rank save tests).
"""

from __future__ import annotations

import io
import pickle
import random

import pytest
import torch

from distckpt.core import CheckpointingException
from distckpt.strategies.torch import (
    GatheredRecords,
    RecordTable,
    _KeyDecl,
    _MetadataUnpickler,
    _Record,
    build_metadata,
    metadata_bytes_and_head,
)
from distckpt.validation import ShardTable, validate_global_integrity


def tensor(key, gshape, offset, local, main=True, flat=None, dtype="torch.float32"):
    return (key, False, dtype, tuple(gshape), tuple(offset), tuple(local), flat, main)


def obj(key, gshape, offset, main=True):
    return (key, True, None, tuple(gshape), tuple(offset), (1,) * len(gshape), None, main)


def validate(*ranks):
    # Through pickle, as the gather sends them.
    validate_global_integrity(
        [pickle.loads(pickle.dumps(ShardTable.build(r, shards))) for r, shards in enumerate(ranks)]
    )


def flat_layout(dp=3, numel=10):
    """A (2, 5) tensor in two row chunks, each flattened over ``dp`` ranks."""
    ranks = []
    for d in range(dp):
        cuts = [numel * i // dp for i in range(dp + 1)]
        ranks.append([tensor("w", (4, 5), (2 * c, 0), (2, 5), flat=(cuts[d], cuts[d + 1])) for c in range(2)])
    return ranks


def test_valid_layouts_pass_whatever_the_number_of_axes_per_rank():
    validate(
        [
            tensor("a", (4, 6), (0, 0), (2, 6)),
            tensor("s", (), (), ()),
            obj("o", (2,), (0,)),
            tensor("x", (2, 3, 4), (0, 0, 0), (1, 3, 4)),
        ],
        [
            tensor("a", (4, 6), (2, 0), (2, 6)),
            obj("o", (2,), (1,)),
            tensor("x", (2, 3, 4), (1, 0, 0), (1, 3, 4)),
        ],
        [tensor("a", (4, 6), (0, 0), (2, 6), main=False)],  # a replica
    )
    validate(*flat_layout())


def test_flattened_ranges_overlapping_name_the_rank():
    ranks = flat_layout()
    key, _, dt, gs, off, loc, (start, stop), main = ranks[2][1]
    ranks[2][1] = (key, False, dt, gs, off, loc, (start - 1, stop), main)
    with pytest.raises(
        CheckpointingException,
        match=r"'w': flattened ranges overlap in the chunk at offset "
        r"\[2, 0\]: \[5, 10\) on rank 2 starts before 6",
    ):
        validate(*ranks)


def test_flattened_range_gap_and_short_chunk():
    ranks = flat_layout()
    ranks[1][0] = ranks[1][0][:7] + (False,)
    with pytest.raises(
        CheckpointingException,
        match=r"flattened range \[3, 6\) of the chunk at offset \[0, 0\] "
        r"is not written by any main replica",
    ):
        validate(*ranks)
    ranks = flat_layout()
    ranks[2][0] = ranks[2][0][:7] + (False,)
    with pytest.raises(
        CheckpointingException, match=r"flattened range \[6, 10\) of the chunk at offset \[0, 0\]"
    ):
        validate(*ranks)


def test_tensor_overlap_and_gap_name_region_and_ranks():
    with pytest.raises(
        CheckpointingException,
        match=r"'a': main replicas overlap at global region \[1:2, 0:6\] "
        r"\(written by ranks \[0, 1\]\)",
    ):
        validate([tensor("a", (4, 6), (0, 0), (2, 6))], [tensor("a", (4, 6), (1, 0), (3, 6))])
    with pytest.raises(
        CheckpointingException, match=r"'a': global region \[2:3, 0:6\] of shape \[4, 6\] is not covered"
    ):
        validate([tensor("a", (4, 6), (0, 0), (2, 6))], [tensor("a", (4, 6), (3, 0), (1, 6))])


def test_objects_duplicated_or_missing():
    with pytest.raises(
        CheckpointingException,
        match=r"'o': offset \[1\] is written by more than one main "
        r"replica \(ranks 0 and 2\)",
    ):
        validate([obj("o", (2,), (1,))], [obj("o", (2,), (0,))], [obj("o", (2,), (1,))])
    with pytest.raises(
        CheckpointingException, match=r"'o': 1 of 3 shards have no main replica \(e.g. offset \[1\]\)"
    ):
        validate([obj("o", (3,), (0,))], [obj("o", (3,), (2,)), obj("o", (3,), (1,), main=False)])


def test_a_pattern_checked_once_still_catches_each_key_that_differs_from_it():
    """Keys with the same rows, ranks and properties are checked once; a key that differs in
    anything but its name (global shape, rows, ranks, flattened or not) is checked on its own."""
    layers = [f"layer{i}.w" for i in range(6)]
    good = (
        [tensor(k, (4, 6), (0, 0), (2, 6)) for k in layers],
        [tensor(k, (4, 6), (2, 0), (2, 6)) for k in layers],
    )
    validate(*good)
    # Same rows as the layers before it, but a larger tensor: a gap.
    with pytest.raises(CheckpointingException, match=r"'late': global region \[4:6, 0:6\] of shape \[6, 6\]"):
        validate(
            good[0] + [tensor("late", (6, 6), (0, 0), (2, 6))],
            good[1] + [tensor("late", (6, 6), (2, 0), (2, 6))],
        )
    # Same shape, one row moved: an overlap.
    with pytest.raises(CheckpointingException, match=r"'late': main replicas overlap"):
        validate(
            good[0] + [tensor("late", (4, 6), (0, 0), (2, 6))],
            good[1] + [tensor("late", (4, 6), (1, 0), (3, 6))],
        )
    # Same geometry held by one rank twice: a duplicate.
    with pytest.raises(CheckpointingException, match=r"'late': main replicas overlap"):
        validate(
            good[0] + [tensor("late", (4, 6), (0, 0), (2, 6)), tensor("late", (4, 6), (0, 0), (2, 6))],
            good[1] + [tensor("late", (4, 6), (2, 0), (2, 6))],
        )


def test_errors_name_offenders_in_rank_order_whatever_the_grouping_of_equal_layouts():
    # Ranks 0 and 2 have the same layout (checked together), rank 1 another.
    with pytest.raises(
        CheckpointingException,
        match=r"'o': offset \[1\] is written by more than one main "
        r"replica \(ranks 1 and 2\)",
    ):
        validate(
            [obj("o", (3,), (0,)), tensor("x", (2,), (0,), (2,))],
            [obj("o", (3,), (1,))],
            [obj("o", (3,), (1,)), tensor("x", (2,), (0,), (2,), main=False)],
        )


def test_disagreements_name_the_ranks_of_each_side():
    with pytest.raises(
        CheckpointingException,
        match=r"'a': ranks disagree on the global shape: \[4, 6\] on rank\(s\) "
        r"0,2; \[4, 7\] on rank\(s\) 1",
    ):
        validate(
            [tensor("a", (4, 6), (0, 0), (2, 6))],
            [tensor("a", (4, 7), (2, 0), (2, 7))],
            [tensor("a", (4, 6), (2, 0), (2, 6))],
        )
    with pytest.raises(
        CheckpointingException,
        match=r"'a': ranks disagree on the dtype: torch.float32 on rank\(s\) 0; "
        r"torch.bfloat16 on rank\(s\) 1",
    ):
        validate(
            [tensor("a", (4, 6), (0, 0), (2, 6))],
            [tensor("a", (4, 6), (2, 0), (2, 6), dtype="torch.bfloat16")],
        )
    with pytest.raises(
        CheckpointingException,
        match=r"key 'a' is a ShardedTensor on rank\(s\) 1 and a ShardedObject "
        r"on rank\(s\) 0",
    ):
        validate([obj("a", (2,), (0,))], [tensor("a", (2,), (0,), (2,))])
    with pytest.raises(CheckpointingException, match=r"'w': flattened on rank\(s\) 1 but not on the others"):
        validate([tensor("w", (4, 5), (0, 0), (2, 5))], [tensor("w", (4, 5), (2, 0), (2, 5), flat=(0, 10))])


def random_tables(seed):
    rnd = random.Random(seed)
    decls = {
        "a": _KeyDecl(False, torch.float32, (8, 6)),
        "b": _KeyDecl(False, torch.bfloat16, (4, 1, 100), (4, 10, 10)),
        "obj/shard_0_1": _KeyDecl(True),
        "s": _KeyDecl(False, torch.float32, ()),
        "big": _KeyDecl(False, torch.int64, (2**40,)),
        "none": _KeyDecl(False, torch.float32, (3,)),
        "many": _KeyDecl(False, torch.float32, (50, 2**33)),
    }  # more chunks than the small-key path takes
    tables = []
    for rank in range(5):
        recs = [
            _Record(
                "a",
                rnd.choice([(0, 0), (2, 3), (4, 0), (6, 3)]),
                (2, 3),
                f"__{rank}_0.distcp",
                rnd.randint(0, 2**34),
                rnd.randint(1, 100),
                rnd.randint(0, 2**32 - 1),
            )
            for _ in range(rnd.randint(0, 6))
        ]
        recs += [
            _Record(
                "b",
                (rnd.randint(0, 3), 0, rnd.randint(0, 90)),
                (1, 1, rnd.randint(1, 10)),
                f"__{rank}_1.distcp",
                i * 10,
                5,
                9,
            )
            for i in range(rnd.randint(0, 6))
        ]
        recs += [
            _Record(
                "many",
                (rnd.randint(0, 49), rnd.choice([0, 2**32])),
                (1, rnd.choice([7, 2**32])),
                f"__{rank}_0.distcp",
                rnd.randint(0, 2**40),
                rnd.randint(0, 2**31 + 5),
                1,
            )
            for _ in range(rnd.randint(10, 30))
        ]
        if rank == 2:
            recs += [
                _Record("obj/shard_0_1", (), (), "__2_0.distcp", 3, 4, 5),
                _Record("s", (), (), "__2_0.distcp", 30, 4, 5),
                _Record("big", (2**39,), (2**38,), "__2_0.distcp", 2**33, 2**32 + 1, 5),
            ]
        tables.append(pickle.loads(pickle.dumps(RecordTable.of(decls, recs))))
    return tables


@pytest.mark.parametrize("seed", range(4))
def test_metadata_bytes_unpickle_to_the_metadata_objects(seed):
    records = GatheredRecords.of(random_tables(seed))
    md = build_metadata(records, "ckpt")
    raw, _ = metadata_bytes_and_head(records, "ckpt", md.storage_meta.save_id)
    for loaded in (pickle.loads(raw), _MetadataUnpickler(io.BytesIO(raw)).load()):
        assert loaded == md
        assert loaded.mcore_data == md.mcore_data == {"b": {"nd_reformulated_orig_global_shape": (4, 10, 10)}}
        assert list(loaded.storage_data.items()) == list(md.storage_data.items())
        for fqn, meta in md.state_dict_metadata.items():
            assert loaded.state_dict_metadata[fqn] == meta
            if hasattr(meta, "chunks"):
                assert [tuple(c.offsets) for c in meta.chunks] == sorted(
                    tuple(c.offsets) for c in meta.chunks
                )
    assert md.state_dict_metadata["none"].chunks == []


def test_record_table_ranges_and_cached_crcs():
    decls = {"a": _KeyDecl(False, torch.float32, (4,)), "o": _KeyDecl(True)}
    recs = [
        _Record("a", (0,), (2,), "f0", 0, 8, 11),
        _Record("o", (), (), "f1", 0, 3, 12),
        _Record("a", (2,), (2,), "f0", 8, 8, 13),
    ]
    table = RecordTable.of(decls, recs)
    assert table.ranges() == [("f0", 0, 8, 11, "a"), ("f1", 0, 3, 12, "o"), ("f0", 8, 8, 13, "a")]
    assert [r[3] for r in table.with_crcs([1, 2, 3]).ranges()] == [1, 2, 3]
    assert table.decls() == decls
    with pytest.raises(CheckpointingException, match="undeclared key 'b'"):
        RecordTable.of(decls, [_Record("b", (0,), (1,), "f", 0, 1, 0)])
