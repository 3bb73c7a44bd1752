"""The clouds an object-store test runs on, as ``pytest.param``s of its ``cloud`` argument.

Every object-store behaviour is tested on S3 (moto), GCS (fake-gcs-server) and Azure Blob
(Azurite), each a real server on 127.0.0.1 (``tests/conftest.py``: one per session; the
``cloud_url`` fixture gives a fresh prefix on the test's cloud). The default run keeps the whole
matrix affordable on a 2-core machine: a test names the clouds it runs on by default, and the others
run it under the ``slow`` marker (``pytest -m slow``, which CI runs after the default run).
"""

from __future__ import annotations

from typing import List

import pytest

__all__ = ["CLOUDS", "URL_FIXTURES", "clouds"]

CLOUDS = ("s3", "gcs", "azure")
# the fixture (tests/conftest.py) that gives a fresh prefix on each cloud's server
URL_FIXTURES = {"s3": "s3_url", "gcs": "gcs_url", "azure": "az_url"}


def clouds(*default: str) -> List:
    """Parameters for ``cloud``: the clouds in ``default`` (all three when none is named) in the
    default run, the others marked ``slow``."""
    unknown = set(default) - set(CLOUDS)
    if unknown:
        raise ValueError(f"unknown clouds {sorted(unknown)}; known: {CLOUDS}")
    chosen = default or CLOUDS
    return [pytest.param(c, id=c, marks=() if c in chosen else pytest.mark.slow) for c in CLOUDS]
