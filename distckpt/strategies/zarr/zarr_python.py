"""Teaching zarr-python the data types distckpt writes that it does not know (bfloat16, float8).

zarr-python is not a dependency of distckpt: it, numpy and ml_dtypes are imported only when
:func:`register_zarr_python_dtypes` is called.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Tuple

logger = logging.getLogger("distckpt.strategies.zarr")  # the package's logger, as before the split

_ZARR_PYTHON_EXTRA = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_zarr_python_registered = False


def register_zarr_python_dtypes() -> bool:
    """Teach zarr-python (3.1 and earlier) the bfloat16 and float8 data types, via ml_dtypes.

    Tensorstore and zarrs read these names natively; zarr-python 3.1 rejects them ("No Zarr
    data type found that matches 'bfloat16'"). After this call ``zarr.open`` returns such arrays
    with ml_dtypes dtypes, bit-exact. Best effort: returns False if zarr-python's internals
    differ from what this expects (nothing is registered then).
    """
    global _zarr_python_registered
    if _zarr_python_registered:
        return True
    try:
        from typing import ClassVar

        # Optional third-party packages, imported only here.
        import ml_dtypes
        import numpy as np
        from zarr.core.dtype import data_type_registry
        from zarr.core.dtype.npy.float import BaseFloat
    except ImportError:
        return False

    def make(name: str):
        np_dtype = np.dtype(getattr(ml_dtypes, name))

        @dataclass(frozen=True, kw_only=True)
        class MlDtypesFloat(BaseFloat):
            dtype_cls = type(np_dtype)
            _zarr_v3_name = name
            _zarr_v2_names: ClassVar[Tuple[str, ...]] = (name,)

            def to_native_dtype(self):
                return np_dtype

            @property
            def item_size(self) -> int:
                return np_dtype.itemsize

        MlDtypesFloat.__name__ = MlDtypesFloat.__qualname__ = f"MlDtypes_{name}"
        return MlDtypesFloat

    try:
        for name in _ZARR_PYTHON_EXTRA:
            if hasattr(ml_dtypes, name) and name not in data_type_registry.contents:
                data_type_registry.register(name, make(name))
    except Exception as e:  # noqa: BLE001 - an optional convenience; never fatal
        logger.debug("could not register ml_dtypes types with zarr-python: %s", e)
        return False
    _zarr_python_registered = True
    return True
