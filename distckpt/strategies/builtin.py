"""The built-in strategies, registered in one place above them.

:mod:`distckpt.strategies.base` holds the interfaces and the registry and imports no strategy;
the strategy modules import the interfaces and register nothing themselves. This module, imported
by :mod:`distckpt` itself (so before any lookup can happen), fills the registry:

==============  =====================  ===========================================
action          backend, version       strategy
==============  =====================  ===========================================
save/load       ``torch_dist`` 1       :mod:`distckpt.strategies.torch_dist` (default)
save/load       ``zarr`` 1 and 2       :mod:`distckpt.strategies.zarr` (version 1, the legacy
                                       layout, is read; a save asked for it writes version 2)
save/load       ``torch_dcp`` 1        :mod:`distckpt.strategies.torch_dcp`
common          ``torch`` 1            :mod:`distckpt.strategies.common` (``common.pt``)
==============  =====================  ===========================================

A backend of your own registers the same way: ``register_default_strategy(action, backend,
version, factory)`` from your module (docs/architecture.md, "Adding a backend").
"""

from __future__ import annotations

from distckpt.strategies.base import StrategyAction, register_default_strategy
from distckpt.strategies.common import TorchCommonLoadStrategy, TorchCommonSaveStrategy
from distckpt.strategies.torch_dcp import BACKEND_NAME as TORCH_DCP
from distckpt.strategies.torch_dcp import TorchDCPLoadShardedStrategy, TorchDCPSaveShardedStrategy
from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from distckpt.strategies.zarr import (
    BACKEND as ZARR,
)
from distckpt.strategies.zarr import (
    FORMAT_VERSION as ZARR_VERSION,
)
from distckpt.strategies.zarr import (
    LEGACY_VERSION as ZARR_LEGACY_VERSION,
)
from distckpt.strategies.zarr import (
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
)

SAVE, LOAD = StrategyAction.SAVE_SHARDED, StrategyAction.LOAD_SHARDED


def register_builtin_strategies() -> None:
    """Fill the registry with the built-in strategies (idempotent: a second call changes nothing)."""
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy)
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy)
    register_default_strategy(SAVE, "torch_dist", 1, TorchDistSaveShardedStrategy)
    register_default_strategy(LOAD, "torch_dist", 1, TorchDistLoadShardedStrategy)
    # One zarr writer: ("zarr", 1) asks for the legacy layout, which is not written any more; it gets
    # the current one, and metadata.json records version 2.
    for version in (ZARR_LEGACY_VERSION, ZARR_VERSION):
        register_default_strategy(SAVE, ZARR, version, ZarrSaveShardedStrategy)
        register_default_strategy(LOAD, ZARR, version, ZarrLoadShardedStrategy)
    register_default_strategy(SAVE, TORCH_DCP, 1, TorchDCPSaveShardedStrategy)
    register_default_strategy(LOAD, TORCH_DCP, 1, TorchDCPLoadShardedStrategy)


register_builtin_strategies()
