"""Tests of distckpt.strategies: the backends, the sidecar index, files, fully parallel and async I/O."""
