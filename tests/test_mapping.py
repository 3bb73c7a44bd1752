"""Specification tests for distckpt.mapping: the sharded state dict data model (single process)."""

import numpy as np
import pytest
import torch

from distckpt.core import CheckpointingException
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)


def make_st(**overrides):
    """A valid 2-D ShardedTensor (rank 1 of a 2-way split on axis 0) with fields overridable."""
    fields = dict(
        key="w",
        data=None,
        dtype=torch.float32,
        local_shape=(2, 4),
        global_shape=(4, 4),
        global_offset=(2, 0),
        axis_fragmentations=(2, 1),
    )
    fields.update(overrides)
    return ShardedTensor(**fields)


def flat_pieces(key, chunk, chunk_rank_offsets, boundaries):
    """Split the (non-flat) ``chunk`` into flat ShardedTensors at the given flat boundaries."""
    flat = chunk.flatten()
    return [
        ShardedTensor.from_rank_offsets_flat(
            key, flat[a:b], chunk.shape, *chunk_rank_offsets, flattened_range=slice(a, b)
        )
        for a, b in zip(boundaries[:-1], boundaries[1:])
    ]


# ----------------------------------------------------------------------------- is_main_replica


def test_is_main_replica_int_zero_only():
    assert is_main_replica(0)
    assert not is_main_replica(1)


def test_is_main_replica_tuple_requires_all_zeros():
    assert is_main_replica((0, 0, 0))
    assert not is_main_replica((0, 1, 0))


# ----------------------------------------------------------------------------- from_rank_offsets


def test_from_rank_offsets_tp_split_on_axis_0():
    data = torch.zeros(2, 3)
    st = ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))
    assert st.data is data
    assert st.dtype == torch.float32
    assert st.local_shape == (2, 3)
    assert st.global_shape == (4, 3)
    assert st.global_offset == (2, 0)
    assert st.axis_fragmentations == (2, 1)
    assert st.replica_id == 0 and st.prepend_axis_num == 0 and st.flattened_range is None


def test_from_rank_offsets_tp_split_on_axis_1():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (1, 3, 4))
    assert st.global_shape == (2, 12)
    assert st.global_offset == (0, 9)
    assert st.axis_fragmentations == (1, 4)


def test_from_rank_offsets_2d_grid():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 2), (1, 2, 3))
    assert st.global_shape == (4, 9)
    assert st.global_offset == (2, 6)
    assert st.axis_fragmentations == (2, 3)


def test_from_rank_offsets_prepended_axis_has_local_size_one():
    st = ShardedTensor.from_rank_offsets(
        "layers.w", torch.zeros(2, 3), (0, 3, 4), (1, 1, 2), prepend_axis_num=1
    )
    assert st.local_shape == (2, 3)
    assert st.global_shape == (4, 4, 3)
    assert st.global_offset == (3, 2, 0)
    assert st.axis_fragmentations == (4, 2, 1)


def test_from_rank_offsets_unlisted_prepended_axis_has_global_size_one():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(3), prepend_axis_num=2)
    assert st.global_shape == (1, 1, 3)
    assert st.global_offset == (0, 0, 0)


def test_from_rank_offsets_passes_replica_id_and_init_kwargs():
    st = ShardedTensor.from_rank_offsets(
        "w", torch.zeros(2), (0, 0, 2), replica_id=(0, 3), allow_shape_mismatch=True
    )
    assert st.replica_id == (0, 3)
    assert st.allow_shape_mismatch is True


@pytest.mark.parametrize(
    "rank_offsets",
    [
        pytest.param([(0, 0, 2), (0, 1, 2)], id="axis_twice"),
        pytest.param([(2, 0, 2)], id="axis_out_of_range"),
        pytest.param([(-1, 0, 2)], id="negative_axis"),
        pytest.param([(0, 2, 2)], id="rank_offset_equals_fragm"),
        pytest.param([(0, 0, 0)], id="zero_fragm"),
    ],
)
def test_from_rank_offsets_rejects_invalid_rank_offsets(rank_offsets):
    with pytest.raises(CheckpointingException, match="'w'"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), *rank_offsets)


def test_from_rank_offsets_rejects_flattened_range_and_points_to_flat_constructor():
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 0, 2), flattened_range=slice(0, 4))


# ----------------------------------------------------------------------------- from_rank_offsets_flat


def test_from_rank_offsets_flat_uses_layout_of_non_flat_chunk():
    data = torch.arange(4.0)
    st = ShardedTensor.from_rank_offsets_flat("w", data, (2, 4), (0, 1, 2), flattened_range=slice(3, 7))
    assert st.data is data
    assert st.local_shape == (2, 4)
    assert st.global_shape == (4, 4)
    assert st.global_offset == (2, 0)
    assert st.flattened_range == slice(3, 7)


def test_from_rank_offsets_flat_requires_flattened_range():
    with pytest.raises(CheckpointingException, match="flattened_range"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 4), (0, 1, 2))


def test_from_rank_offsets_flat_requires_1d_data():
    with pytest.raises(CheckpointingException, match="1-D"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(2, 2), (2, 4), flattened_range=slice(0, 4))


def test_from_rank_offsets_flat_requires_data_size_equal_to_range_length():
    with pytest.raises(CheckpointingException, match="3 elements"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 4), flattened_range=slice(0, 3))


# ----------------------------------------------------------------------------- validation


def test_constructor_normalises_shapes_to_int_tuples():
    st = make_st(
        local_shape=torch.Size([2, 4]),
        global_shape=[np.int64(4), 4],
        global_offset=np.array([2, 0]),
        axis_fragmentations=[2, 1],
    )
    assert st.local_shape == (2, 4) and type(st.local_shape) is tuple
    assert all(type(v) is int for v in st.global_shape + st.global_offset + st.axis_fragmentations)


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(dict(global_offset=(2, 0, 0)), "different lengths", id="offset_len_ne_global_len"),
        pytest.param(dict(local_shape=(2, 4, 1)), "prepend_axis_num", id="local_plus_prepend_ne_global"),
        pytest.param(dict(global_offset=(-2, 0)), "negative global_offset", id="negative_offset"),
        pytest.param(dict(local_shape=(-2, 4)), "negative shape", id="negative_local_shape"),
        pytest.param(
            dict(global_shape=(4, -4), local_shape=(2, 0)), "negative shape", id="negative_global_shape"
        ),
        pytest.param(dict(global_offset=(3, 0)), "exceeds global size", id="offset_plus_local_gt_global"),
        pytest.param(
            dict(
                local_shape=(4,),
                global_shape=(2, 4),
                global_offset=(2, 0),
                prepend_axis_num=1,
                axis_fragmentations=None,
            ),
            "prepended axis",
            id="prepended_offset_ge_global",
        ),
        pytest.param(dict(axis_fragmentations=(2,)), "axis_fragmentations", id="fragmentations_wrong_length"),
        pytest.param(dict(axis_fragmentations=(2, 0)), "axis_fragmentations", id="fragmentation_below_one"),
        pytest.param(dict(data=torch.zeros(2, 3)), r"data shape \(2, 3\)", id="data_shape_ne_local_shape"),
        pytest.param(dict(data=torch.zeros(2, 4, dtype=torch.int64)), "dtype", id="data_dtype_ne_dtype"),
        pytest.param(dict(data=torch.zeros(2, 2), flattened_range=slice(0, 4)), "1-D", id="flat_data_not_1d"),
        pytest.param(
            dict(data=torch.zeros(3), flattened_range=slice(0, 4)), "4 elements", id="flat_data_size_ne_range"
        ),
        pytest.param(dict(flattened_range=slice(0, 4, 2)), "step", id="flat_range_step_2"),
        pytest.param(dict(flattened_range=slice(0, 9)), "stop <= 8", id="flat_range_past_chunk_end"),
        pytest.param(dict(flattened_range=slice(5, 3)), "start <= stop", id="flat_range_start_after_stop"),
        pytest.param(dict(flattened_range=slice(-1, 3)), "0 <= start", id="flat_range_negative_start"),
        pytest.param(
            dict(global_shape=(5, 4), axis_fragmentations=None, flattened_range=slice(0, 4)),
            "regular grid",
            id="flat_global_not_multiple_of_local",
        ),
        pytest.param(
            dict(global_offset=(1, 0), flattened_range=slice(0, 4)),
            "regular grid",
            id="flat_offset_not_multiple_of_local",
        ),
        pytest.param(
            dict(global_shape=(6, 4), flattened_range=slice(0, 4)),
            "regular grid",
            id="flat_global_ne_local_times_fragmentation",
        ),
        pytest.param(dict(local_shape=(2, float("nan"))), "must be an integer", id="nan_in_local_shape"),
        pytest.param(dict(global_shape=(4.0, 4)), "must be an integer", id="float_in_global_shape"),
        pytest.param(dict(global_offset=(2, "0")), "must be an integer", id="str_in_global_offset"),
    ],
)
def test_validate_metadata_integrity_rejects_inconsistent_metadata(overrides, message):
    with pytest.raises(CheckpointingException, match=message) as excinfo:
        make_st(**overrides)
    assert "'w'" in str(excinfo.value)


def test_validate_metadata_integrity_rechecks_after_mutation():
    st = make_st()
    st.global_offset = (3, 0)
    with pytest.raises(CheckpointingException, match="exceeds global size"):
        st.validate_metadata_integrity()


def test_flat_tensor_on_regular_grid_without_fragmentations_is_accepted():
    st = make_st(axis_fragmentations=None, data=torch.zeros(5), flattened_range=slice(1, 6))
    assert st.flattened_range == slice(1, 6)


# ----------------------------------------------------------------------------- geometry


def test_global_slice_uses_ints_on_prepended_axes():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 3, 4), (2, 1, 2), prepend_axis_num=1)
    assert st.global_slice() == (3, slice(0, 2), slice(3, 6))


def test_global_slice_selects_local_data_from_global_tensor():
    global_t = torch.arange(24.0).view(4, 6)
    local = global_t[2:4, 3:6].clone()
    st = ShardedTensor.from_rank_offsets("w", local, (0, 1, 2), (1, 1, 2))
    assert torch.equal(global_t[st.global_slice()], local)


def test_local_chunk_offset_in_global_is_grid_index():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 2, 4), (1, 1, 3))
    assert st.local_chunk_offset_in_global() == (2, 1)


def test_local_chunk_offset_in_global_keeps_prepended_offsets():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 5, 8), (1, 1, 2), prepend_axis_num=1)
    assert st.local_chunk_offset_in_global() == (5, 1, 0)


def test_local_chunk_offset_in_global_rejects_irregular_offset():
    st = make_st(global_shape=(5, 4), global_offset=(3, 0), axis_fragmentations=None)
    with pytest.raises(CheckpointingException, match="not a multiple"):
        st.local_chunk_offset_in_global()


def test_max_allowed_chunks_uses_fragmentations_and_prepended_sizes():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 6), (1, 0, 3), prepend_axis_num=1)
    assert st.max_allowed_chunks() == (6, 3, 1)


def test_max_allowed_chunks_derived_from_shapes_without_fragmentations():
    st = make_st(global_shape=(8, 4), axis_fragmentations=None)
    assert st.max_allowed_chunks() == (4, 1)


def test_max_allowed_chunks_rejects_irregular_shape_without_fragmentations():
    st = make_st(global_shape=(5, 4), axis_fragmentations=None)
    with pytest.raises(CheckpointingException, match="no regular grid"):
        st.max_allowed_chunks()


def test_global_coordinates_of_flat_tensor_index_global_tensor():
    global_t = torch.arange(16.0).view(4, 4)
    chunk = global_t[2:4]
    (st,) = flat_pieces("w", chunk, [(0, 1, 2)], [3, 7])
    coords = st.global_coordinates()
    assert [c.tolist() for c in coords] == [[2, 3, 3, 3], [3, 0, 1, 2]]
    assert np.array_equal(global_t.numpy()[coords], st.data.numpy())


def test_global_coordinates_of_non_flat_tensor_include_prepended_axes():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(1, 2), (0, 3, 4), (1, 1, 2), prepend_axis_num=1)
    coords = st.global_coordinates()
    assert [c.tolist() for c in coords] == [[3, 3], [1, 1], [0, 1]]


# ----------------------------------------------------------------------------- narrow


def test_narrow_non_flat_pieces_of_two_ranks_tile_smaller_global_tensor():
    global_t = torch.arange(24.0).view(8, 3)
    ranks = [
        ShardedTensor.from_rank_offsets("w", global_t[4 * r : 4 * r + 4].clone(), (0, r, 2)) for r in range(2)
    ]

    narrowed = [piece for st in ranks for piece in st.narrow(0, 1, 2)]

    assert [p.global_shape for p in narrowed] == [(4, 3), (4, 3)]
    assert [p.global_offset for p in narrowed] == [(0, 0), (2, 0)]
    assert all(p.local_shape == (2, 3) for p in narrowed)
    assembled = torch.full((4, 3), float("nan"))
    for p in narrowed:
        assembled[p.global_slice()] = p.data
    expected = torch.cat([global_t[1:3], global_t[5:7]])
    assert torch.equal(assembled, expected)


def test_narrow_non_flat_returns_view_of_local_data():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (1, 1, 2))
    (piece,) = st.narrow(1, 2, 3)
    assert piece.global_shape == (4, 6) and piece.global_offset == (0, 3)
    piece.data.fill_(1.0)
    assert st.data[:, 2:5].eq(1.0).all() and st.data.sum() == 12


def test_narrow_respects_prepended_axes():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2), (0, 1, 3), (1, 1, 2), prepend_axis_num=1)
    (piece,) = st.narrow(0, 0, 2)
    assert piece.global_shape == (3, 4, 2)
    assert piece.global_offset == (1, 2, 0)
    assert piece.local_shape == (2, 2)


def test_narrow_without_data_updates_metadata_only():
    (piece,) = make_st().narrow(0, 1, 1)
    assert piece.data is None
    assert (piece.local_shape, piece.global_shape, piece.global_offset) == ((1, 4), (2, 4), (1, 0))


def test_narrow_flat_contiguous_overlap_is_view_with_shifted_range():
    chunk = torch.arange(12.0).view(4, 3)
    (st,) = flat_pieces("w", chunk, [(0, 0, 1)], [2, 10])

    (piece,) = st.narrow(0, 1, 2)  # rows 1..2 are flat [3, 9) of the chunk

    assert piece.local_shape == (2, 3)
    assert piece.flattened_range == slice(0, 6)
    assert torch.equal(piece.data, chunk[1:3].flatten())
    assert piece.data.data_ptr() == st.data[1:].data_ptr()  # a view, not a copy


def test_narrow_flat_partial_overlap_at_both_ends():
    chunk = torch.arange(12.0).view(4, 3)
    (st,) = flat_pieces("w", chunk, [(0, 0, 1)], [4, 8])
    (piece,) = st.narrow(0, 2, 2)  # rows 2..3 are flat [6, 12)
    assert piece.flattened_range == slice(0, 2)
    assert piece.data.tolist() == [6.0, 7.0]


def test_narrow_flat_without_overlap_is_empty():
    chunk = torch.arange(12.0).view(4, 3)
    (st,) = flat_pieces("w", chunk, [(0, 0, 1)], [0, 3])
    assert st.narrow(0, 2, 2) == []


def test_narrow_flat_across_rows_is_one_range_with_gathered_data():
    # Narrowing columns of a flat range that spans rows keeps elements that are not adjacent in
    # `data`, yet they are adjacent in the narrowed chunk: still one range, data is a copy.
    chunk = torch.arange(12.0).view(3, 4)
    (st,) = flat_pieces("w", chunk, [(1, 0, 1)], [2, 11])

    (piece,) = st.narrow(1, 1, 2)  # keeps columns 1..2

    # Kept: (0,2) (1,1) (1,2) (2,1) (2,2) -> narrowed flat indices 1..5
    assert piece.local_shape == (3, 2)
    assert piece.flattened_range == slice(1, 6)
    assert piece.data.tolist() == [2.0, 5.0, 6.0, 9.0, 10.0]


@pytest.mark.parametrize("dim, start, length", [(0, 1, 1), (1, 1, 2), (1, 0, 1), (2, 2, 3), (2, 0, 5)])
def test_narrow_flat_pieces_tile_narrowed_global_tensor_like_non_flat_narrow(dim, start, length):
    # Two TP ranks along axis 1, each chunk split flat across 3 DP ranks at uneven boundaries.
    global_t = torch.arange(2 * 6 * 5, dtype=torch.float64).view(2, 6, 5)
    non_flat, flat = [], []
    for tp in range(2):
        chunk = global_t[:, 3 * tp : 3 * tp + 3].clone()
        non_flat += ShardedTensor.from_rank_offsets("w", chunk, (1, tp, 2)).narrow(dim, start, length)
        for st in flat_pieces("w", chunk, [(1, tp, 2)], [0, 7, 8, 30]):
            flat += st.narrow(dim, start, length)

    reference = torch.zeros(non_flat[0].global_shape, dtype=torch.float64)
    for p in non_flat:
        reference[p.global_slice()] = p.data
    rebuilt = torch.full_like(reference, float("nan"))
    for p in flat:
        assert p.global_shape == reference.shape
        rebuilt[p.global_coordinates()] = p.data
    assert torch.equal(rebuilt, reference)


@pytest.mark.parametrize(
    "dim, start, length, message",
    [
        pytest.param(2, 0, 1, "cannot narrow dim", id="dim_out_of_range"),
        pytest.param(0, 1, 2, "outside local size", id="start_plus_length_past_end"),
        pytest.param(0, -1, 1, "outside local size", id="negative_start"),
    ],
)
def test_narrow_rejects_bad_arguments(dim, start, length, message):
    with pytest.raises(CheckpointingException, match=message):
        make_st().narrow(dim, start, length)


def test_narrow_rejects_irregular_grid_along_axis():
    st = make_st(global_shape=(5, 4), axis_fragmentations=None)
    with pytest.raises(CheckpointingException, match="regular grid"):
        st.narrow(0, 0, 1)


# ----------------------------------------------------------------------------- init_data / without_data


def test_init_data_allocates_local_shape_with_dtype():
    st = make_st(dtype=torch.bfloat16)
    st.init_data("cpu")
    assert st.data.shape == (2, 4) and st.data.dtype == torch.bfloat16 and st.data.device.type == "cpu"


def test_init_data_allocates_flat_range_length_for_flat_tensor():
    st = make_st(flattened_range=slice(1, 6))
    st.init_data("meta")
    assert st.data.shape == (5,) and st.data.is_meta


def test_init_data_uses_init_fn():
    st = make_st()
    st.init_data("cpu", init_fn=torch.ones)
    assert torch.equal(st.data, torch.ones(2, 4))


def test_init_data_keeps_existing_data():
    data = torch.zeros(2, 4)
    st = make_st(data=data)
    st.init_data("meta", init_fn=torch.ones)
    assert st.data is data


def test_without_data_keeps_metadata_and_leaves_original_intact():
    data = torch.zeros(2)
    st = make_st(data=data, flattened_range=slice(3, 5), replica_id=(1, 0))
    bare = st.without_data()
    assert bare.data is None and st.data is data
    assert (
        bare.key,
        bare.local_shape,
        bare.global_shape,
        bare.global_offset,
        bare.flattened_range,
        bare.replica_id,
    ) == (
        "w",
        (2, 4),
        (4, 4),
        (2, 0),
        slice(3, 5),
        (1, 0),
    )


def test_str_is_short_and_omits_data_values():
    st = make_st(data=torch.full((2, 4), 12345.0))
    text = str(st)
    assert "'w'" in text and "(4, 4)" in text and "(2, 0)" in text
    assert "12345" not in text


# ----------------------------------------------------------------------------- ShardedObject


def test_sharded_object_unique_key_format():
    obj = ShardedObject("rng_state", {"seed": 1}, (1, 2), (0, 1))
    assert obj.unique_key == "rng_state/shard_0.1_1.2"


def test_sharded_object_round_trips_through_unique_key_with_slashes_in_key():
    obj = ShardedObject("decoder/layers/3/rng", object(), (2, 4, 8), (1, 0, 7), replica_id=2)
    rebuilt = ShardedObject.empty_from_unique_key(obj.unique_key, replica_id=5)
    assert (rebuilt.key, rebuilt.global_shape, rebuilt.global_offset) == (
        "decoder/layers/3/rng",
        (2, 4, 8),
        (1, 0, 7),
    )
    assert rebuilt.data is None and rebuilt.replica_id == 5


def test_sharded_object_round_trip_splits_on_last_shard_marker():
    obj = ShardedObject("odd/shard_key", None, (3,), (2,))
    rebuilt = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert rebuilt.key == "odd/shard_key" and rebuilt.global_offset == (2,)


@pytest.mark.parametrize(
    "unique_key",
    ["rng_state", "rng_state/shard_0.1", "rng_state/shard_0.x_1.2", "rng_state/shard_0_1_2", "k/shard_2_1"],
)
def test_sharded_object_empty_from_malformed_unique_key_raises(unique_key):
    with pytest.raises(CheckpointingException):
        ShardedObject.empty_from_unique_key(unique_key)


@pytest.mark.parametrize(
    "shape, offset",
    [((1, 2), (0,)), ((2,), (2,)), ((2,), (-1,)), ((2.0,), (0,))],
    ids=["length_mismatch", "offset_eq_shape", "negative_offset", "float_shape"],
)
def test_sharded_object_rejects_invalid_metadata(shape, offset):
    with pytest.raises(CheckpointingException, match="'obj'"):
        ShardedObject("obj", None, shape, offset)


def test_sharded_object_without_data():
    obj = ShardedObject("o", [1, 2], (2,), (1,), replica_id=1)
    bare = obj.without_data()
    assert bare.data is None and obj.data == [1, 2]
    assert bare.unique_key == obj.unique_key and bare.replica_id == 1


# ----------------------------------------------------------------------------- factories


def halves_factory(key, tensor, replica_id=0):
    """A factory saving ``tensor`` as two sharded halves (dim 0) and concatenating them back."""

    def build_fn(k, t, rid, flattened_range):
        top, bottom = t.chunk(2)
        return {
            "top": ShardedTensor.from_rank_offsets(f"{k}.top", top, replica_id=rid),
            "bottom": ShardedTensor.from_rank_offsets(f"{k}.bottom", bottom, replica_id=rid),
        }

    def merge_fn(sub_state_dict):
        return torch.cat([sub_state_dict["top"], sub_state_dict["bottom"]])

    return ShardedTensorFactory(key, tensor, build_fn, merge_fn, replica_id)


def fake_load(sharded_state_dict):
    """What a load returns: every ShardedTensor replaced by (a copy of) its data."""
    from distckpt.dict_utils import dict_list_map_outplace

    return dict_list_map_outplace(
        lambda x: x.data.clone() if isinstance(x, ShardedTensor) else x, sharded_state_dict
    )


def test_factory_build_passes_key_data_replica_and_range():
    calls = []
    data = torch.zeros(2)
    factory = ShardedTensorFactory(
        "k", data, lambda *a: calls.append(a) or {"x": 1}, lambda d: d, (0, 1), slice(0, 2)
    )
    assert factory.build() == {"x": 1}
    assert calls == [("k", data, (0, 1), slice(0, 2))]


def test_factory_without_data_keeps_functions():
    factory = halves_factory("w", torch.zeros(4))
    bare = factory.without_data()
    assert bare.data is None and bare.build_fn is factory.build_fn and bare.merge_fn is factory.merge_fn


def test_apply_factories_replaces_factories_in_nested_dicts_and_lists():
    sd = {
        "a": {"w": halves_factory("a.w", torch.arange(4.0))},
        "l": [1, halves_factory("l.w", torch.arange(2.0))],
    }
    apply_factories(sd)
    assert set(sd["a"]["w"]) == {"top", "bottom"}
    assert sd["a"]["w"]["bottom"].key == "a.w.bottom"
    assert torch.equal(sd["a"]["w"]["bottom"].data, torch.tensor([2.0, 3.0]))
    assert sd["l"][0] == 1 and sd["l"][1]["top"].key == "l.w.top"


def test_apply_factory_merges_restores_split_tensor():
    weight = torch.arange(6.0).view(3, 2).repeat(2, 1)
    sd = {"layer": {"weight": halves_factory("layer.weight", weight), "bias": torch.ones(2)}, "step": 7}
    with_factories = {"layer": dict(sd["layer"]), "step": 7}
    apply_factories(sd)
    loaded = fake_load(sd)
    assert isinstance(loaded["layer"]["weight"], dict)

    merged = apply_factory_merges(loaded, with_factories)

    assert merged is loaded
    assert torch.equal(merged["layer"]["weight"], weight)
    assert torch.equal(merged["layer"]["bias"], torch.ones(2)) and merged["step"] == 7


def test_apply_factory_merges_with_factories_extracted_as_dicts_from_lists():
    from distckpt.dict_utils import extract_matching_values

    sd = {"layers": [torch.zeros(1), halves_factory("l1", torch.arange(4.0))]}
    factories, _ = extract_matching_values(
        sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sd)
    merged = apply_factory_merges(fake_load(sd), factories)
    assert torch.equal(merged["layers"][1], torch.arange(4.0))


def test_apply_factory_merges_ignores_non_factory_keys_missing_from_loaded():
    loaded = {"a": 1}
    assert apply_factory_merges(loaded, {"a": 1, "extra": LocalNonpersistentObject(3)}) == {"a": 1}


def test_apply_factory_merges_rejects_factory_missing_from_loaded():
    with pytest.raises(CheckpointingException, match=r"\('layer', 'weight'\)"):
        apply_factory_merges({"layer": {}}, {"layer": {"weight": halves_factory("w", torch.zeros(2))}})


def test_apply_factory_merges_rejects_lists_of_different_lengths():
    with pytest.raises(CheckpointingException, match="different lengths"):
        apply_factory_merges({"l": [1, 2]}, {"l": [1]})


# ----------------------------------------------------------------------------- LocalNonpersistentObject


def test_local_nonpersistent_object_unwraps_to_same_object():
    payload = {"not": "saved"}
    assert LocalNonpersistentObject(payload).unwrap() is payload


def _outcome(sh: ShardedTensor):
    try:
        sh.validate_metadata_integrity()
        return "ok"
    except CheckpointingException as e:
        return str(e)


def test_the_one_pass_check_agrees_with_the_full_checks_on_every_case(monkeypatch):
    """``_plain_chunk_in_bounds`` only short-cuts: for valid and invalid shapes, offsets and
    fragmentations alike, validation gives the same verdict and words the same error with it
    and without it."""
    import itertools
    import random

    rng = random.Random(7)
    values = [-1, 0, 1, 2, 3, 4, 8]
    cases = 0
    for ndim in (1, 2):
        for _ in range(400):
            sh = ShardedTensor.from_rank_offsets(
                "k", torch.zeros((2,) * ndim), *[(i, 0, 1) for i in range(ndim)]
            )
            sh.data = None
            sh.local_shape = tuple(rng.choice(values) for _ in range(ndim))
            sh.global_shape = tuple(rng.choice(values) for _ in range(ndim))
            sh.global_offset = tuple(rng.choice(values) for _ in range(ndim + rng.choice([0, 0, 0, 1])))
            sh.axis_fragmentations = rng.choice(
                [None, tuple(rng.choice(values) for _ in range(ndim)), (1,) * (ndim + 1)]
            )
            with_shortcut = _outcome(sh)
            with monkeypatch.context() as m:
                m.setattr(ShardedTensor, "_plain_chunk_in_bounds", lambda self: False)
                assert _outcome(sh) == with_shortcut, (
                    sh.local_shape,
                    sh.global_shape,
                    sh.global_offset,
                    sh.axis_fragmentations,
                )
            cases += with_shortcut == "ok"
    assert cases > 20  # the valid cases were exercised too, not only errors
    # A list or a torch.Size where a tuple is expected goes the full way and is normalised.
    sh = ShardedTensor.from_rank_offsets("k", torch.zeros(4), (0, 0, 1))
    sh.global_shape = torch.Size([4])
    sh.validate_metadata_integrity()
    assert type(sh.global_shape) is tuple and list(itertools.chain(sh.global_shape)) == [4]
