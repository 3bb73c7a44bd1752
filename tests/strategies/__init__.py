"""Tests of distckpt.strategies: the backends, the ranged and device reads, fully parallel and async saves."""
