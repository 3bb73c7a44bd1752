"""Specification tests for distckpt.dict_utils: nested dict/list utilities."""

import numpy as np
import pytest
import torch

from distckpt.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    inspect_types,
    map_reduce,
    merge,
    nested_items_iter,
    nested_values,
)


def is_tensor(x):
    return isinstance(x, torch.Tensor)


# ----------------------------------------------------------------------------- extract_matching_values


def test_extract_matching_values_splits_nested_dict_keeping_structure():
    t1, t2 = torch.zeros(1), torch.ones(1)
    sd = {"a": t1, "b": 1, "sub": {"c": t2, "d": "x"}}
    matching, nonmatching = extract_matching_values(sd, is_tensor)
    assert matching == {"a": t1, "sub": {"c": t2}}
    assert nonmatching == {"b": 1, "sub": {"d": "x"}}


def test_extract_matching_values_drops_subtrees_without_matches_or_without_rest():
    t = torch.zeros(1)
    matching, nonmatching = extract_matching_values({"only_t": {"t": t}, "only_n": {"n": 1}}, is_tensor)
    assert matching == {"only_t": {"t": t}}
    assert nonmatching == {"only_n": {"n": 1}}


def test_extract_matching_values_keeps_empty_containers_on_nonmatching_side():
    matching, nonmatching = extract_matching_values({"e": {}, "l": [], "x": [[], {}]}, is_tensor)
    assert matching == {}
    assert nonmatching == {"e": {}, "l": [], "x": [[], {}]}


def test_extract_matching_values_appends_list_elements_without_preserving_indices():
    t = torch.zeros(1)
    matching, nonmatching = extract_matching_values({"l": [1, t, 2, {"t": t, "n": 3}]}, is_tensor)
    assert matching == {"l": [t, {"t": t}]}
    assert nonmatching == {"l": [1, 2, {"n": 3}]}


def test_extract_matching_values_with_lists_as_dicts_keys_by_index():
    t = torch.zeros(1)
    matching, nonmatching = extract_matching_values([1, t, [2, t]], is_tensor, return_lists_as_dicts=True)
    assert matching == {1: t, 2: {1: t}}
    assert nonmatching == {0: 1, 2: {0: 2}}


def test_extract_matching_values_never_calls_predicate_on_containers():
    seen = []
    extract_matching_values({"a": [1, {"b": 2}], "c": {}}, lambda x: seen.append(x) or False)
    assert seen == [1, 2]


def test_extract_matching_values_rejects_non_container_top_level():
    with pytest.raises(ValueError, match="dict or a list"):
        extract_matching_values(torch.zeros(1), is_tensor)


# ----------------------------------------------------------------------------- diff


def test_diff_of_equal_structures_is_empty():
    x = {"a": torch.arange(3), "b": [1, "s", {"c": 2.5}], "n": None}
    y = {"a": torch.arange(3), "b": [1, "s", {"c": 2.5}], "n": None}
    assert diff(x, y) == ([], [], [])


def test_diff_reports_keys_present_on_one_side_only():
    only_left, only_right, mismatch = diff({"a": 1, "s": {"x": 1, "y": 2}}, {"b": 1, "s": {"x": 1}})
    assert only_left == [("a",), ("s", "y")]
    assert only_right == [("b",)]
    assert mismatch == []


def test_diff_reports_surplus_list_indices_with_paths():
    assert diff({"l": [1, 2, 3]}, {"l": [1]}) == ([("l", 1), ("l", 2)], [], [])
    assert diff([0], [0, 5]) == ([], [(1,)], [])


def test_diff_reports_mismatching_leaf_with_path_and_types():
    _, _, mismatch = diff({"a": {"b": [1, 2]}}, {"a": {"b": [1, 3]}})
    assert mismatch == [(("a", "b", 1), int, int)]


def test_diff_compares_tensor_values():
    assert diff({"t": torch.tensor([1.0, 2.0])}, {"t": torch.tensor([1.0, 2.5])})[2] == [
        (("t",), torch.Tensor, torch.Tensor)
    ]


def test_diff_treats_tensor_shape_mismatch_as_mismatch():
    assert len(diff(torch.zeros(2, 3), torch.zeros(3, 2))[2]) == 1
    assert len(diff(torch.zeros(1), torch.zeros(1, 1))[2]) == 1


def test_diff_treats_type_mismatch_as_mismatch():
    assert diff({"a": 1}, {"a": 1.0})[2] == [(("a",), int, float)]
    assert diff({"a": torch.zeros(1)}, {"a": 0.0})[2] == [(("a",), torch.Tensor, float)]
    assert diff({"a": {"b": 1}}, {"a": [1]})[2] == [(("a",), dict, list)]


def test_diff_treats_uncomparable_leaves_as_mismatch():
    class Ambiguous:
        def __ne__(self, other):
            raise RuntimeError("no single truth value")

    assert len(diff(Ambiguous(), Ambiguous())[2]) == 1


def test_diff_compares_numpy_arrays_by_value():
    assert diff({"a": np.arange(3)}, {"a": np.arange(3)}) == ([], [], [])
    assert len(diff({"a": np.arange(3)}, {"a": np.arange(1, 4)})[2]) == 1


# ----------------------------------------------------------------------------- iteration and mapping


def test_nested_values_yields_leaves_of_dicts_and_lists_in_order():
    assert list(nested_values({"a": 1, "b": [2, {"c": 3}], "d": {}})) == [1, 2, 3]


def test_nested_items_iter_yields_assignable_container_and_key():
    x = {"a": 1, "b": [2, {"c": 3}]}
    items = list(nested_items_iter(x))
    assert [(k, v) for _, k, v in items] == [("a", 1), (0, 2), ("c", 3)]
    container, k, _ = items[1]
    container[k] = 20
    assert x["b"][0] == 20


def test_dict_map_applies_function_to_every_leaf_in_place():
    x = {"a": 1, "b": {"c": 2}, "l": [3]}
    assert dict_map(lambda v: v * 10, x) is None
    assert x == {"a": 10, "b": {"c": 20}, "l": [30]}


def test_dict_map_with_key_passes_innermost_key():
    x = {"a": 1, "b": {"c": 2}}
    dict_map_with_key(lambda k, v: f"{k}={v}", x)
    assert x == {"a": "a=1", "b": {"c": "c=2"}}


def test_dict_list_map_inplace_keeps_container_identity():
    inner = [1, 2]
    x = {"l": inner, "d": {"v": 3}}
    result = dict_list_map_inplace(lambda v: v + 1, x)
    assert result is x and x["l"] is inner
    assert x == {"l": [2, 3], "d": {"v": 4}}


def test_dict_list_map_inplace_on_leaf_returns_mapped_leaf():
    assert dict_list_map_inplace(lambda v: v + 1, 1) == 2


def test_dict_list_map_outplace_builds_new_containers_and_leaves_input_untouched():
    x = {"l": [1, 2], "d": {"v": 3}}
    result = dict_list_map_outplace(lambda v: v + 1, x)
    assert result == {"l": [2, 3], "d": {"v": 4}}
    assert x == {"l": [1, 2], "d": {"v": 3}}
    assert result["l"] is not x["l"] and result["d"] is not x["d"]


def test_inspect_types_prints_nesting_and_leaf_types(capsys):
    inspect_types({"a": torch.zeros(2, 3), "b": [1, "long string " * 10]})
    out = capsys.readouterr().out
    assert "> a: Tensor of shape (2, 3)" in out
    assert "- 0: [<class 'int'>]: 1" in out
    assert "(truncated)" in out


# ----------------------------------------------------------------------------- merge


def test_merge_unites_dicts_recursively_in_place():
    x1 = {"a": 1, "s": {"x": 1}}
    result = merge(x1, {"b": 2, "s": {"y": 2}})
    assert result is x1
    assert x1 == {"a": 1, "b": 2, "s": {"x": 1, "y": 2}}


def test_merge_merges_equal_length_lists_element_wise():
    x1 = {"l": [{"a": 1}, {"b": 2}]}
    merge(x1, {"l": [{"c": 3}, {"d": 4}]})
    assert x1 == {"l": [{"a": 1, "c": 3}, {"b": 2, "d": 4}]}


def test_merge_rejects_lists_of_different_lengths():
    with pytest.raises(ValueError, match=r"different lengths .* \('l',\)"):
        merge({"l": [{}]}, {"l": [{}, {}]})


def test_merge_rejects_colliding_leaves_naming_key_path():
    with pytest.raises(ValueError, match=r"\('s', 'x'\)"):
        merge({"s": {"x": 1}}, {"s": {"x": 2}})


def test_merge_rejects_leaf_colliding_with_container():
    with pytest.raises(ValueError, match=r"\('a',\)"):
        merge({"a": 1}, {"a": {"b": 2}})


# ----------------------------------------------------------------------------- map_reduce


def test_map_reduce_groups_maps_and_reduces():
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    result = map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum)
    assert result == {"a": 12, "b": 15, "c": 6}


def test_map_reduce_defaults_group_identical_items_into_lists():
    assert map_reduce([3, 1, 3]) == {3: [3, 3], 1: [1]}
