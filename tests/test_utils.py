"""Specification tests for distckpt.utils: splitting sharded state dicts and renaming keys."""

import pytest
import torch

from distckpt.core import CheckpointingException
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
)
from distckpt.utils import (
    _sharded_object_id,
    _sharded_tensor_shard_id,
    add_prefix_for_sharding,
    apply_prefix_mapping,
    extract_nonpersistent,
    extract_sharded_base,
    extract_sharded_tensors,
    extract_sharded_tensors_and_factories,
    extract_sharded_tensors_or_nonpersistent,
    replace_prefix_for_sharding,
    zip_strict,
)


def st(key):
    return ShardedTensor.from_rank_offsets(key, torch.zeros(2))


def factory(key, captured_key=None):
    """A factory building one sub-tensor named ``<key>.part`` (or ``captured_key`` if given)."""

    def build_fn(k, data, replica_id, flattened_range):
        return {"part": ShardedTensor.from_rank_offsets(captured_key or f"{k}.part", data)}

    return ShardedTensorFactory(key, torch.zeros(2), build_fn, lambda d: d["part"])


@pytest.fixture
def mixed():
    return {
        "t": st("t"),
        "o": ShardedObject("o", 1, (1,), (0,)),
        "f": factory("f"),
        "n": LocalNonpersistentObject(5),
        "plain": 7,
        "l": [st("l0"), 3],
    }


def keys_of(x):
    from distckpt.dict_utils import nested_values

    return sorted(getattr(v, "key", repr(v)) for v in nested_values(x))


# ----------------------------------------------------------------------------- extraction


def test_extract_sharded_tensors(mixed):
    sharded, rest = extract_sharded_tensors(mixed)
    assert keys_of(sharded) == ["l0", "t"]
    assert set(rest) == {"o", "f", "n", "plain", "l"} and rest["l"] == [3]


def test_extract_sharded_tensors_and_factories(mixed):
    sharded, _ = extract_sharded_tensors_and_factories(mixed)
    assert keys_of(sharded) == ["f", "l0", "t"]


def test_extract_sharded_tensors_or_nonpersistent(mixed):
    sharded, rest = extract_sharded_tensors_or_nonpersistent(mixed)
    assert set(sharded) == {"t", "f", "n", "l"}
    assert set(rest) == {"o", "plain", "l"}


def test_extract_sharded_base(mixed):
    sharded, rest = extract_sharded_base(mixed)
    assert keys_of(sharded) == ["f", "l0", "o", "t"]
    assert set(rest) == {"n", "plain", "l"}


def test_extract_nonpersistent(mixed):
    nonpersistent, rest = extract_nonpersistent(mixed)
    assert list(nonpersistent) == ["n"] and nonpersistent["n"].unwrap() == 5
    assert "n" not in rest


# ----------------------------------------------------------------------------- prefixes


def test_add_prefix_for_sharding_renames_all_sharded_leaves(mixed):
    add_prefix_for_sharding(mixed, "model.")
    assert keys_of(extract_sharded_base(mixed)[0]) == ["model.f", "model.l0", "model.o", "model.t"]
    assert mixed["plain"] == 7


def test_replace_prefix_for_sharding_replaces_leading_prefix_only():
    sd = {"a": st("dec.layers.dec.w"), "b": [ShardedObject("dec.rng", None, (1,), (0,))]}
    replace_prefix_for_sharding(sd, "dec.", "decoder.")
    assert sd["a"].key == "decoder.layers.dec.w"
    assert sd["b"][0].key == "decoder.rng"


def test_replace_prefix_for_sharding_rejects_key_without_prefix():
    with pytest.raises(CheckpointingException, match="'enc.w'"):
        replace_prefix_for_sharding({"a": st("dec.w"), "b": st("enc.w")}, "dec.", "decoder.")


def test_apply_prefix_mapping_uses_first_matching_prefix_and_skips_others():
    sd = {"a": st("x.y.w"), "b": st("x.z"), "c": st("other.w")}
    apply_prefix_mapping(sd, {"x.y.": "Y.", "x.": "X."})
    assert [sd[k].key for k in "abc"] == ["Y.w", "X.z", "other.w"]


def test_apply_prefix_mapping_maps_each_key_once_even_for_chained_prefixes():
    sd = {"a": st("a.w"), "b": st("b.w")}
    apply_prefix_mapping(sd, {"a.": "b.", "b.": "c."})
    assert (sd["a"].key, sd["b"].key) == ("b.w", "c.w")


def test_apply_prefix_mapping_renames_factory_and_tensors_it_builds():
    sd = {"f": factory("dec.fc1"), "g": factory("dec.fc2", captured_key="dec.fc2_weight_parts")}
    apply_prefix_mapping(sd, {"dec.": "decoder."})
    assert sd["f"].key == "decoder.fc1"
    apply_factories(sd)
    assert sd["f"]["part"].key == "decoder.fc1.part"
    assert sd["g"]["part"].key == "decoder.fc2_weight_parts"


def test_apply_prefix_mapping_does_not_rename_factory_output_twice():
    sd = {"f": factory("a.fc")}
    apply_prefix_mapping(sd, {"a.": "b.", "b.": "c."})
    apply_factories(sd)
    assert sd["f"]["part"].key == "b.fc.part"


def test_apply_prefix_mapping_composes_over_repeated_calls_on_factories():
    sd = {"f": factory("a.fc")}
    apply_prefix_mapping(sd, {"a.": "b."})
    apply_prefix_mapping(sd, {"b.": "c."})
    apply_factories(sd)
    assert sd["f"]["part"].key == "c.fc.part"


# ----------------------------------------------------------------------------- misc


def test_zip_strict_zips_equal_lengths():
    assert list(zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]


def test_zip_strict_rejects_different_lengths():
    with pytest.raises(CheckpointingException, match=r"\[2, 3\]"):
        zip_strict([1, 2], [1, 2, 3])


def test_shard_ids_identify_stored_pieces():
    flat = ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(3), (2, 2), (0, 1, 2), flattened_range=slice(1, 4)
    )
    assert _sharded_tensor_shard_id(flat) == ("w", (2, 0), (1, 4))
    assert _sharded_tensor_shard_id(st("t")) == ("t", (0,), None)
    assert _sharded_object_id(ShardedObject("o", None, (2, 3), (1, 2))) == ("o", (1, 2), (2, 3))


def test_gc_pause_nests_and_load_restores_it_even_after_an_error(tmp_path):
    import gc

    import distckpt
    from distckpt import ShardedTensor
    from distckpt.core import gc_paused

    try:
        assert gc.isenabled()
        with gc_paused():
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled(), "the inner exit must not switch the GC back on"
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled(), "a GC the caller switched off stays off"
        gc.enable()
        distckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path)
        req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
        distckpt.load(req, tmp_path)
        assert gc.isenabled()
        with pytest.raises(CheckpointingException):
            distckpt.load(req, tmp_path / "missing")
        assert gc.isenabled()
    finally:
        gc.enable()
