"""Where a DCP save or load of :mod:`distckpt.dcp` goes: DCP's ``checkpoint_id`` as a distckpt location.

DCP passes ``checkpoint_id`` (``dcp.save(..., checkpoint_id=...)``) to ``reset`` of the storage
writer and reader; its meaning is the storage's. Here it is what the constructor takes: a local
path, a ``file://`` URL or an object-store URL (``s3://``, ``gs://``, ``az://``, ``memory://``),
opened with the storage options given to the constructor.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union
from urllib.parse import urlparse

from distckpt import storage
from distckpt.core import CheckpointingException

__all__ = ["AtLocation", "Location", "is_location", "resolve"]

Location = storage.Location


def is_location(checkpoint_id: Any) -> bool:
    """Whether ``checkpoint_id`` names a place distckpt can hold a checkpoint (DCP's
    ``validate_checkpoint_id``): a path, a ``file://`` URL or an object-store URL."""
    if isinstance(checkpoint_id, (os.PathLike, storage.Store)):
        return True
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        return False
    if "://" not in checkpoint_id:
        return True
    scheme = urlparse(checkpoint_id).scheme.lower()
    return scheme == "file" or scheme in storage.OBJECT_SCHEMES


def resolve(location: Location, storage_options: Optional[Dict[str, Any]]) -> Union[Any, storage.Store]:
    """``location`` as the strategies take it (a local ``Path`` or a ``Store``)."""
    if not is_location(location):
        raise CheckpointingException(
            f"{location!r} is not a checkpoint location for distckpt.dcp: give a path or a URL "
            f"(file://, {', '.join(s + '://' for s in sorted(storage.OBJECT_SCHEMES))})"
        )
    return storage.resolve(location, storage_options)


class AtLocation:
    """What DCP asks of a storage writer or reader about its location: ``validate_checkpoint_id``
    and ``checkpoint_id`` (DCP logs it); the location is ``self.location``."""

    location: Location

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_location(checkpoint_id)

    @property
    def checkpoint_id(self) -> Location:
        """The location this writer or reader works on."""
        return self.location
