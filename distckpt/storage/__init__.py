"""Where a checkpoint's bytes live: a location (path or URL) opened as a :class:`Store`.

``s3://``, ``s3a://``, ``gs://``, ``az://`` (``abfs://``, ``adl://``, ``azure://``) and
``memory://`` URLs open an :class:`ObjectStore`; plain paths and ``file://`` URLs stay local
directories, on which the strategies keep their POSIX fast paths. See docs/storage.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Union
from urllib.parse import unquote, urlparse

from distckpt import containment
from distckpt.core import CheckpointingException, atomic_write_bytes
from distckpt.storage.base import Store, Writer, coalesce
from distckpt.storage.local import LocalStore

Location = Union[str, os.PathLike, Store]

OBJECT_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "azure", "memory"}

__all__ = [
    "Location",
    "LocalStore",
    "Store",
    "Writer",
    "coalesce",
    "is_remote",
    "local_dir",
    "open_store",
    "resolve",
    "read_bytes",
    "write_bytes",
    "join",
    "OBJECT_SCHEMES",
]


def _scheme(text: str) -> str:
    return text.split("://", 1)[0].lower() if "://" in text else ""


def resolve(location: Location, storage_options: Optional[Dict[str, Any]] = None) -> Union[Path, Store]:
    """A local directory as a ``Path``; any other location as a :class:`Store`.

    The entry points call this once; the strategies receive what it returns.
    """
    if isinstance(location, Store):
        return location.root if location.supports_mmap and hasattr(location, "root") else location
    if isinstance(location, os.PathLike):
        return Path(location)
    if not isinstance(location, str):
        raise CheckpointingException(
            f"checkpoint location must be a path, URL or Store, got {type(location).__name__}"
        )
    scheme = _scheme(location)
    if not scheme:
        return Path(location)
    if scheme == "file":
        return Path(unquote(urlparse(location).path))
    if scheme not in OBJECT_SCHEMES:
        raise CheckpointingException(
            f"{location}: unsupported storage scheme {scheme!r} "
            f"(supported: file, {', '.join(sorted(OBJECT_SCHEMES))})"
        )
    if scheme == "gcs":
        location = "gs://" + location.split("://", 1)[1]
    from distckpt.storage.object import ObjectStore

    return ObjectStore(location, storage_options)


def open_store(location: Location, storage_options: Optional[Dict[str, Any]] = None) -> Store:
    """The :class:`Store` of any location (local directories as :class:`LocalStore`)."""
    if isinstance(location, Store):
        return location
    resolved = resolve(location, storage_options)
    return LocalStore(resolved) if isinstance(resolved, Path) else resolved


def local_root(location: Location) -> Optional[Path]:
    """The local directory of a location whose objects are plain files, else None (a capability
    query: a path, a ``file://`` URL or a :class:`LocalStore` answer with their directory)."""
    if isinstance(location, Store):
        return location.local_root
    resolved = resolve(location)
    return resolved if isinstance(resolved, Path) else None


def is_remote(location: Any) -> bool:
    """True for a location without the local fast paths (no mmap): an object store."""
    if isinstance(location, Store):
        return not location.supports_mmap
    return isinstance(location, str) and _scheme(location) in OBJECT_SCHEMES


def local_dir(location: Any) -> Optional[Path]:
    """The local directory of a location that has one, else None."""
    if is_remote(location):
        return None
    resolved = resolve(location)
    return resolved if isinstance(resolved, Path) else None


def join(location: Union[Path, Store], name: str) -> str:
    """``name`` inside ``location``, for messages."""
    return str(location / name) if isinstance(location, Path) else location.where(name)


def read_bytes(location: Union[Path, Store], name: str, source: Any = None) -> bytes:
    """The whole object ``name``; FileNotFoundError if it is missing. ``name`` goes through the
    containment rule (:mod:`distckpt.containment`): a local file is opened beneath the directory,
    never through a symlink that leads out; ``source`` is the file that named it (for errors)."""
    if isinstance(location, Path):
        return containment.read_beneath(location, name, source if source is not None else location)
    return bytes(location.get(name))


def write_bytes(location: Union[Path, Store], name: str, data: bytes) -> None:
    """Write a small object durably and atomically (local: temp file + fsync + rename; the rename
    replaces the name itself, and the folders above it are checked to lie beneath ``location``)."""
    if isinstance(location, Path):
        atomic_write_bytes(containment.path_beneath(location, name, location), data)
    else:
        location.put(name, data)
