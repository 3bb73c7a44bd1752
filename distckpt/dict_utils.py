"""Generic utilities over nested dicts and lists (the shape of every (sharded) state dict).

Leaves are whatever is neither a ``dict`` nor a ``list``. Tuples are leaves everywhere except in
:func:`diff`, which compares them element-wise. Key paths are tuples of dict keys and list
indices, outermost first.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple, Union

import torch

Nested = Union[dict, list]
KeyPath = Tuple[Any, ...]


def extract_matching_values(
    x: Nested,
    predicate: Callable[[Any], bool],
    return_lists_as_dicts: bool = False,
) -> Tuple[Nested, Nested]:
    """Split the leaves of ``x`` into a matching and a non-matching structure.

    Both results mirror the nesting of ``x``. A key appears in the matching result only if
    something under it matched; it appears in the non-matching result if something under it
    did not match, or if its value was an empty container (so empty containers survive on the
    non-matching side). The predicate is called on leaves only, never on containers.

    Lists are rebuilt by appending, so list indices are *not* preserved, unless
    ``return_lists_as_dicts`` is set: then each list becomes a dict keyed by the original index.

    Raises:
        ValueError: ``x`` is neither a dict nor a list.
    """
    if isinstance(x, dict):
        matching: Nested = {}
        nonmatching: Nested = {}
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                sub_match, sub_nonmatch = extract_matching_values(v, predicate, return_lists_as_dicts)
                if sub_match:
                    matching[k] = sub_match
                if sub_nonmatch or not v:
                    nonmatching[k] = sub_nonmatch
            elif predicate(v):
                matching[k] = v
            else:
                nonmatching[k] = v
        return matching, nonmatching

    if isinstance(x, list):
        matching = {} if return_lists_as_dicts else []
        nonmatching = {} if return_lists_as_dicts else []

        def _put(target: Nested, index: int, value: Any) -> None:
            if return_lists_as_dicts:
                target[index] = value  # type: ignore[index]
            else:
                target.append(value)  # type: ignore[union-attr]

        for i, v in enumerate(x):
            if isinstance(v, (dict, list)):
                if not v:
                    # An empty container holds nothing that could match; keep it as it was.
                    _put(nonmatching, i, v)
                    continue
                sub_match, sub_nonmatch = extract_matching_values(v, predicate, return_lists_as_dicts)
                if sub_match:
                    _put(matching, i, sub_match)
                if sub_nonmatch:
                    _put(nonmatching, i, sub_nonmatch)
            elif predicate(v):
                _put(matching, i, v)
            else:
                _put(nonmatching, i, v)
        return matching, nonmatching

    raise ValueError(f"extract_matching_values expects a dict or a list at the top level, got {type(x)}")


def _is_ndarray(x: Any) -> bool:
    # numpy is optional here: if nobody imported it, no leaf can be an ndarray.
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _leaves_differ(x1: Any, x2: Any) -> bool:
    """Whether two leaves differ; anything that cannot be compared counts as different."""
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        if not (isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)):
            return True
        if x1.shape != x2.shape:
            return True
        try:
            if x1.device != x2.device:
                x1, x2 = x1.cpu(), x2.cpu()
            return not torch.equal(x1, x2)
        except Exception:
            return True
    if type(x1) is not type(x2):
        return True
    if _is_ndarray(x1):
        np = sys.modules["numpy"]
        return not (x1.shape == x2.shape and bool(np.array_equal(x1, x2)))
    try:
        return bool(x1 != x2)
    except Exception:
        # e.g. objects holding tensors, whose `!=` has no single truth value
        return True


def diff(x1: Any, x2: Any, prefix: KeyPath = ()) -> Tuple[List[KeyPath], List[KeyPath], list]:
    """Compare two nested structures.

    Returns ``(only_left, only_right, mismatch)``: key paths present only in ``x1``, key paths
    present only in ``x2``, and ``(key_path, type(left), type(right))`` for every pair of leaves
    that differ. Dicts are matched by key, lists and tuples (of the same type on both sides) by
    index, the surplus indices of the longer one being reported as only-left/only-right. Tensors
    are equal when their shapes are equal and ``torch.equal`` holds; other leaves must have the
    same type and compare equal with ``==``.
    """
    only_left: List[KeyPath] = []
    only_right: List[KeyPath] = []
    mismatch: list = []

    def _absorb(sub: Tuple[list, list, list]) -> None:
        only_left.extend(sub[0])
        only_right.extend(sub[1])
        mismatch.extend(sub[2])

    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left.extend(prefix + (k,) for k in x1 if k not in x2)
        only_right.extend(prefix + (k,) for k in x2 if k not in x1)
        for k, v1 in x1.items():
            if k in x2:
                _absorb(diff(v1, x2[k], prefix + (k,)))
    elif isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        common = min(len(x1), len(x2))
        for i in range(common):
            _absorb(diff(x1[i], x2[i], prefix + (i,)))
        only_left.extend(prefix + (i,) for i in range(common, len(x1)))
        only_right.extend(prefix + (i,) for i in range(common, len(x2)))
    elif _leaves_differ(x1, x2):
        mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def inspect_types(x: Any, prefix: KeyPath = (), indent: int = 4) -> None:
    """Print the nesting of ``x`` with the type (and a short preview) of each leaf; a debug aid."""
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        print()
        for k, v in x.items():
            print(f"{pad}> {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
    elif isinstance(x, list):
        print()
        for i, v in enumerate(x):
            print(f"{pad}- {i}: ", end="")
            inspect_types(v, prefix + (i,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {tuple(x.shape)} and dtype {x.dtype}")
    else:
        try:
            preview = str(x)
        except Exception:
            preview = "<str() failed>"
        if len(preview) > 30:
            preview = preview[:30] + "... (truncated)"
        print(f"[{type(x)}]: {preview}")


def nested_values(x: Nested) -> Iterator[Any]:
    """Yield every leaf of a nested dict/list, depth first, in container order."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Nested, Any, Any]]:
    """Yield ``(container, key_or_index, leaf)`` for every leaf of a nested dict/list.

    ``container[key_or_index] = new`` replaces the leaf in place.
    """
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable[[Any], Any], d: Nested) -> None:
    """Replace, in place, every leaf ``v`` of nested dicts/lists by ``f(v)``."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: Nested) -> None:
    """Replace, in place, every leaf ``v`` stored under ``k`` by ``f(k, v)`` (innermost key only)."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Replace every leaf of nested dicts/lists by ``f(leaf)``, keeping the containers.

    Returns ``x`` itself (or ``f(x)`` when ``x`` is a leaf).
    """
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Return a copy of nested dicts/lists with every leaf replaced by ``f(leaf)``.

    The input is left untouched; all containers in the result are new.
    """
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Nested, x2: Nested, key: KeyPath = ()) -> Nested:
    """Merge ``x2`` into ``x1`` in place and return ``x1``.

    Dicts are united recursively; lists must have the same length and are merged element by
    element. Two leaves (or a leaf and a container) meeting at the same place is an error.

    Raises:
        ValueError: lists of different lengths, or colliding non-container values; the message
            names the key path.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge lists of different lengths ({len(x1)} and {len(x2)}) at key path {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    else:
        raise ValueError(
            f"Cannot merge {type(x1).__name__} and {type(x2).__name__} at key path {key}: "
            f"only dicts and equal-length lists can be merged"
        )
    return x1


def map_reduce(
    xs: Iterable[Any],
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[List[Any]], Any] = lambda x: x,
) -> Dict[Any, Any]:
    """Group ``xs`` by ``key_fn``, map each item with ``value_fn``, reduce each group's list.

    Groups appear in order of first occurrence; items keep their order inside a group.
    """
    groups: Dict[Any, List[Any]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(vs) for k, vs in groups.items()}
