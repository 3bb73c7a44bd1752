"""Strategy interfaces and the registry that picks one by (action, backend, version).

Call sequence (every rank calls every method unless a docstring says otherwise):

save:  SaveCommonStrategy.save_common (writes on rank 0 only)
       [SaveCommonStrategy.save_sharded_objects, when the sharded strategy cannot hold objects]
       SaveShardedStrategy.save (writes each rank's main replicas and the strategy's own index;
       raises the same error on every rank if any rank failed)
load:  LoadCommonStrategy.load_common
       LoadShardedStrategy.load_sharded_metadata (strict-mode key checks)
       LoadShardedStrategy.load (reads only the requested pieces; no collectives required)
       [LoadCommonStrategy.load_sharded_objects]

The registry stores *factories*: every lookup returns a fresh strategy object, so no state
(cached plans, open files) leaks from one checkpoint into an unrelated one.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from enum import Enum
from typing import Callable, Dict, Optional, Tuple, Union

from distckpt.core import CheckpointingException
from distckpt.mapping import ShardedStateDict, StateDict
from distckpt.storage import Location


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


_RegistryKey = Tuple[str, str, int]
_default_strategies: Dict[_RegistryKey, Callable[[], object]] = {}


def register_default_strategy(
    action: StrategyAction, backend: str, version: int, strategy: Union[object, Callable[[], object]]
) -> None:
    """Register a strategy (an instance, copied on each lookup, or a zero-argument factory)."""
    if isinstance(strategy, StrategyBase):

        def factory(proto=strategy):
            return copy.deepcopy(proto)
    else:
        factory = strategy
    _default_strategies[(action.value, backend, version)] = factory


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """Return a new instance of the strategy registered for (action, backend, version).

    Raises:
        CheckpointingException: nothing is registered there; the message lists what is.
    """
    try:
        factory = _default_strategies[(action.value, backend, version)]
    except KeyError:
        known = sorted(f"{b} v{v}" for a, b, v in _default_strategies if a == action.value)
        raise CheckpointingException(
            f"no {action.value} strategy registered for backend {backend!r} version {version}; "
            f"registered: {', '.join(known) or 'none'}"
        ) from None
    return factory()


class StrategyBase:
    """Common attributes of every strategy (the abstract methods live in its subclasses)."""

    def __init__(self, backend: Optional[str] = None, version: Optional[int] = None):
        # Both may be left out, as Megatron-Core's load strategies are built (``super().__init__()``):
        # a strategy that names no backend or version leaves those compatibility checks to itself.
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy stores ShardedObjects itself (else the common strategy does)."""
        return False


class LoadStrategyBase(StrategyBase):
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if self.backend is not None and loaded_backend != self.backend:
            raise CheckpointingException(
                f"strategy for backend {self.backend!r} cannot load a {loaded_backend!r} checkpoint"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if self.version is not None and loaded_version > self.version:
            raise CheckpointingException(
                f"checkpoint format version {loaded_version} of backend {self.backend!r} is newer "
                f"than this strategy supports ({self.version})"
            )


class SaveStrategyBase(StrategyBase):
    pass


class LoadCommonStrategy(LoadStrategyBase, ABC):
    @abstractmethod
    def load_common(self, checkpoint_dir: Location) -> StateDict:
        """Load the common (non-sharded) state. Every rank reads it."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Location
    ) -> StateDict:
        """Load the requested ShardedObjects stored as files."""

    def load_sharded_metadata(self, checkpoint_dir: Location) -> ShardedStateDict:
        """Describe the ShardedObjects stored as files (data=None), keyed by unique key."""
        return {}


class LoadShardedStrategy(LoadStrategyBase, ABC):
    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Location) -> StateDict:
        """Read the requested pieces into the given tensors (allocating where data is None).

        Called by every rank on its own requests; needs no collective.
        """

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Location) -> ShardedStateDict:
        """Map each stored tensor key to a data-free ShardedTensor of the whole global tensor."""

    def load_sharded_metadata(self, checkpoint_dir: Location) -> ShardedStateDict:
        """Tensors as in load_tensors_metadata plus stored ShardedObjects keyed by unique key."""
        return self.load_tensors_metadata(checkpoint_dir)

    def load_common_items(self, checkpoint_dir: Location) -> StateDict:
        """Common (non-sharded) values that the sharded format itself holds, nested as saved.

        Empty for checkpoints that keep their common state in ``common.pt`` only; a checkpoint
        written by PyTorch's ``dcp.save`` keeps its non-tensor values (``step``, nested dicts)
        here. Called by any rank, alone; needs no collective.
        """
        return {}

    def remove_sharded_tensors(self, checkpoint_dir: Location, key_prefix: str) -> None:
        raise CheckpointingException(f"backend {self.backend!r} does not support removing sharded tensors")


class SaveCommonStrategy(SaveStrategyBase, ABC):
    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Location) -> None:
        """Write the common state. Called on every rank; writes on rank 0 only."""

    @abstractmethod
    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Location
    ) -> None:
        """Write each main-replica ShardedObject of this rank as its own file."""


class SaveShardedStrategy(SaveStrategyBase, ABC):
    # True for a strategy that hands main replicas to other ranks (the fully parallel wrapper):
    # then any rank may write, not only those whose shards have replica id 0.
    reassigns_replicas = False

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Location) -> None:
        """Write this rank's main replicas and the strategy's index of the checkpoint.

        Called on every rank; on failure of any rank raises the same error on every rank. Does
        not commit: ``metadata.json`` is written by the caller after this returns everywhere.
        """


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded strategy whose writing can run in the background."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Location):
        """Stage the local bytes and return an AsyncRequest that writes them."""

    def prestage(self, sharded_state_dict: ShardedStateDict) -> bool:
        """Start copying the local bytes off the device before the save validates and plans
        (``serialization.save`` calls it first); returns whether anything was started. The
        default starts nothing."""
        return False

    def discard_prestaged(self) -> None:
        """Undo :meth:`prestage` after a save failed before :meth:`async_save` took the copies."""
