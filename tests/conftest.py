"""Session-wide test set-up: the rank-pool fixture and the ``cuda`` marker's skip."""

from __future__ import annotations

import pytest

from tests import harness


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not needs_cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in needs_cuda:
        item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness.shutdown_pools()


@pytest.fixture(scope="session")
def run_ranks():
    """``run_ranks(world_size, fn, *args, timeout=60, **kwargs) -> list`` of per-rank values.

    Runs ``fn`` (a module-level function) on every rank of a gloo process group of
    ``world_size`` processes; the pools are spawned once per session and reused. See
    ``tests/harness.py``.
    """
    return harness.run_ranks
