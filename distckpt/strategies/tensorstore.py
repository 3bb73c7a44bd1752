"""Re-export only, kept for old imports: the tensorstore engine of the ``zarr`` strategy lives in
:mod:`distckpt.strategies.zarr.tensorstore_io`.

It used to be this module, which imported the zarr strategy while the strategy imported it; now
the dependency points one way (this module -> the zarr package).
"""

from __future__ import annotations

from distckpt.strategies.zarr.tensorstore_io import TensorStoreIO, from_numpy, numpy_dtype, to_numpy

__all__ = ["TensorStoreIO", "from_numpy", "numpy_dtype", "to_numpy"]
