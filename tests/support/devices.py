"""Test helpers for the device paths of a save."""

from __future__ import annotations

import contextlib
from typing import Iterator

from distckpt.strategies.torch_dist import write as write_module


@contextlib.contextmanager
def streamed(*devices: str) -> Iterator[None]:
    """Tensors of ``devices`` (besides CUDA) go through the writer threads' slots for the
    duration, so the slot path runs without a GPU."""
    saved = set(write_module.STREAMED_DEVICES)
    write_module.STREAMED_DEVICES.update(devices)
    try:
        yield
    finally:
        write_module.STREAMED_DEVICES.clear()
        write_module.STREAMED_DEVICES.update(saved)
