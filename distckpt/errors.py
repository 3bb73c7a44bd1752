"""The library's exception type and the path alias every module shares (the ground floor: it
imports nothing of ours). :mod:`distckpt.core` re-exports both, their documented home."""

from __future__ import annotations

import os
from typing import Union

PathLike = Union[str, os.PathLike]


class CheckpointingException(Exception):
    """Raised for every user-facing checkpointing error (bad input, bad checkpoint, failed I/O).

    Messages name the key, the file and the rank where they are known.
    """


# Named by its documented home, as tracebacks and pickles have always named it.
CheckpointingException.__module__ = "distckpt.core"
