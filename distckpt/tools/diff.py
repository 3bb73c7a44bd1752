"""Compare two checkpoints (or tensor files) key by key, with bounded memory.

Differences reported: keys only in one side; shape and dtype differences; value differences
(max absolute and relative difference and the number of elements outside
``|a - b| <= atol + rtol * |b|``, NaN equal to NaN); ShardedObjects only in one side or with
different payloads; differences of the common state and of ``content_metadata``.

Tensors are compared one key at a time (small keys in groups of at most
:data:`~distckpt.tools.sources.base.DEFAULT_READ_BUDGET` bytes per side), in blocks of
:data:`BLOCK` elements, so memory stays near twice the largest tensor whatever the size of the
checkpoints. Either side may be anything :func:`~distckpt.tools.inspection.open_source` opens
(a checkpoint, a safetensors file or folder, a ``torch.save`` file), e.g. to check a
conversion.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from distckpt.core import PathLike
from distckpt.dict_utils import diff as nested_diff
from distckpt.tools.inspection import open_source
from distckpt.tools.sources.base import NoProgress, Progress, TensorSource, dtype_name

BLOCK = 1 << 22
"""Elements compared at a time (as float64: 32 MiB per side)."""


@dataclass
class TensorDiff:
    """How tensor ``key`` differs: ``kind`` is ``shape``, ``dtype`` or ``values``."""

    key: str
    kind: str
    detail: str
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    mismatched: Optional[int] = None
    numel: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class DiffReport:
    """Result of :func:`diff_sources`; ``identical`` iff nothing differs."""

    a: str
    b: str
    only_a: List[str] = field(default_factory=list)
    only_b: List[str] = field(default_factory=list)
    tensors: List[TensorDiff] = field(default_factory=list)
    compared: int = 0
    objects_only_a: List[str] = field(default_factory=list)
    objects_only_b: List[str] = field(default_factory=list)
    objects_different: List[str] = field(default_factory=list)
    common: List[str] = field(default_factory=list)
    content_metadata: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (
            self.only_a
            or self.only_b
            or self.tensors
            or self.objects_only_a
            or self.objects_only_b
            or self.objects_different
            or self.common
            or self.content_metadata
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "compared": self.compared,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "tensors": [t.to_json() for t in self.tensors],
            "objects_only_a": self.objects_only_a,
            "objects_only_b": self.objects_only_b,
            "objects_different": self.objects_different,
            "common": self.common,
            "content_metadata": self.content_metadata,
            "notes": self.notes,
        }


def compare_tensors(
    a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0, block: int = BLOCK
) -> Tuple[float, float, int]:
    """``(max_abs, max_rel, mismatched)`` of two tensors of the same shape.

    Floats are compared in float64 (complex in complex128), integers exactly; NaN equals NaN,
    an infinity equals the same infinity, any other NaN/inf disagreement counts as infinitely
    different. ``mismatched`` counts elements with ``|a - b| > atol + rtol * |b|``.
    """
    fa, fb = a.reshape(-1), b.reshape(-1)
    max_abs = max_rel = 0.0
    mismatched = 0
    exact = not (
        a.dtype.is_floating_point or a.dtype.is_complex or b.dtype.is_floating_point or b.dtype.is_complex
    )
    for start in range(0, fa.numel(), block):
        x, y = fa[start : start + block], fb[start : start + block]
        if exact:
            if x.dtype == torch.bool or y.dtype == torch.bool:
                x, y = x.to(torch.int64), y.to(torch.int64)
            d = (x.to(torch.int64) - y.to(torch.int64)).abs().to(torch.float64)
            same = d == 0
            mag = y.to(torch.float64).abs()
        else:
            target = torch.complex128 if (x.dtype.is_complex or y.dtype.is_complex) else torch.float64
            x, y = x.to(target), y.to(target)
            same = (x == y) | (torch.isnan(x) & torch.isnan(y))
            d = (x - y).abs()
            d = torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))
            mag = y.abs()
        tol = atol + rtol * mag
        mismatched += int((~same & ~(d <= tol)).sum())
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
            rel = torch.where(d == 0, torch.zeros_like(d), d / mag)
            max_rel = max(max_rel, float(torch.nan_to_num(rel, nan=math.inf).max()))
    return max_abs, max_rel, mismatched


def diff_sources(
    a: PathLike,
    b: PathLike,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    keys: Optional[str] = None,
    exclude: Optional[str] = None,
    values: bool = True,
    trusted: bool = False,
    progress: Optional[Progress] = None,
) -> DiffReport:
    """Compare ``a`` and ``b`` (see the module docstring).

    Args:
        keys / exclude: regular expressions (``re.search``) selecting the tensor and object keys
            to compare; the common state is compared unless ``keys`` is given.
        values: compare tensor values (False: keys, shapes and dtypes only).

    Raises:
        CheckpointingException: either side cannot be opened or read.
    """
    progress = progress or NoProgress()
    with open_source(a, trusted) as sa, open_source(b, trusted) as sb:
        report = DiffReport(str(sa.path), str(sb.path))
        select = _selector(keys, exclude)
        ta = {k: m for k, m in sa.tensors().items() if select(k)}
        tb = {k: m for k, m in sb.tensors().items() if select(k)}
        report.only_a = [k for k in ta if k not in tb]
        report.only_b = [k for k in tb if k not in ta]
        both = [k for k in ta if k in tb]
        same_shape = []
        for k in both:
            ma, mb = ta[k], tb[k]
            if ma.shape != mb.shape:
                report.tensors.append(TensorDiff(k, "shape", f"{list(ma.shape)} vs {list(mb.shape)}"))
                continue
            if ma.dtype != mb.dtype:
                report.tensors.append(
                    TensorDiff(k, "dtype", f"{dtype_name(ma.dtype)} vs {dtype_name(mb.dtype)}")
                )
            same_shape.append(k)
        report.compared = len(both)
        if values:
            _compare_values(sa, sb, same_shape, atol, rtol, progress, report)
        _compare_objects(sa, sb, select, report)
        if keys is None:
            _compare_common(sa, sb, report)
        return report


def _selector(keys: Optional[str], exclude: Optional[str]):
    inc = re.compile(keys) if keys else None
    exc = re.compile(exclude) if exclude else None
    return lambda k: (inc is None or inc.search(k) is not None) and (exc is None or exc.search(k) is None)


def _compare_values(
    sa: TensorSource,
    sb: TensorSource,
    keys: List[str],
    atol: float,
    rtol: float,
    progress: Progress,
    report: DiffReport,
) -> None:
    metas = sa.tensors()
    progress.start(sum(metas[k].nbytes for k in keys), "comparing")
    dtype_diffs = {t.key: t for t in report.tensors if t.kind == "dtype"}
    for group in sa.group_keys(keys):
        left = dict(sa.iter_tensors(group))
        right = dict(sb.iter_tensors(group))
        for k in group:
            x, y = left.pop(k), right.pop(k)
            max_abs, max_rel, bad = compare_tensors(x, y, atol, rtol)
            numel = x.numel()
            del x, y
            progress.advance(metas[k].nbytes)
            if k in dtype_diffs:  # already a difference; add what the values say
                d = dtype_diffs[k]
                d.max_abs, d.max_rel, d.mismatched, d.numel = max_abs, max_rel, bad, numel
                continue
            if bad:
                report.tensors.append(
                    TensorDiff(k, "values", f"{bad} of {numel} elements differ", max_abs, max_rel, bad, numel)
                )


def _compare_objects(sa: TensorSource, sb: TensorSource, select, report: DiffReport) -> None:
    oa = [k for k in sa.objects() if select(k)]
    ob = [k for k in sb.objects() if select(k)]
    report.objects_only_a = [k for k in oa if k not in ob]
    report.objects_only_b = [k for k in ob if k not in oa]
    for k in oa:
        if k in ob:
            only_l, only_r, mismatch = nested_diff(sa.read_object(k), sb.read_object(k))
            if only_l or only_r or mismatch:
                report.objects_different.append(k)


def _compare_common(sa: TensorSource, sb: TensorSource, report: DiffReport) -> None:
    only_l, only_r, mismatch = nested_diff(sa.common(), sb.common())
    report.common = (
        [f"only in A: {_path(p)}" for p in only_l]
        + [f"only in B: {_path(p)}" for p in only_r]
        + [f"different: {_path(p)}" for p, _, _ in mismatch]
    )
    ca, cb = sa.content_metadata(), sb.content_metadata()
    if ca != cb:
        only_l, only_r, mismatch = nested_diff(ca or {}, cb or {})
        report.content_metadata = (
            [f"only in A: {_path(p)}" for p in only_l]
            + [f"only in B: {_path(p)}" for p in only_r]
            + [f"different: {_path(p)}" for p, _, _ in mismatch]
        ) or ["different"]


def _path(path: Tuple[Any, ...]) -> str:
    return ".".join(map(str, path)) or "(root)"
