"""What the tools read from: every kind of tensor source, and what a source knows without reading data.

- :mod:`~distckpt.tools.sources.base`: :class:`TensorSource` (the base every source fills in), the
  plain metadata (:class:`TensorMeta`, :class:`ObjectMeta`), progress reporting and dtype names;
- :mod:`~distckpt.tools.sources.checkpoint`: :class:`CheckpointSource`, a committed checkpoint of
  any registered backend (distckpt's, Megatron-Core's, plain PyTorch DCP);
- :mod:`~distckpt.tools.sources.files`: :class:`SafetensorsSource` and :class:`TorchFileSource`,
  plain tensor files.

:func:`distckpt.tools.inspection.open_source` picks the right one for a path. The names of
``distckpt.tools.sources`` from when it was one module (the base's) still import from here.
"""

from distckpt.tools.sources.base import (
    DEFAULT_READ_BUDGET,
    NoProgress,
    ObjectMeta,
    Progress,
    Shape,
    TensorMeta,
    TensorSource,
    did_you_mean,
    dtype_itemsize,
    dtype_name,
    parse_dtype,
)
from distckpt.tools.sources.checkpoint import CheckpointSource
from distckpt.tools.sources.files import SafetensorsSource, TorchFileSource, is_safetensors

__all__ = [
    "DEFAULT_READ_BUDGET",
    "CheckpointSource",
    "NoProgress",
    "ObjectMeta",
    "Progress",
    "SafetensorsSource",
    "Shape",
    "TensorMeta",
    "TensorSource",
    "TorchFileSource",
    "did_you_mean",
    "dtype_itemsize",
    "dtype_name",
    "is_safetensors",
    "parse_dtype",
]
