"""Shared test setup: tier markers by folder, loopback DNS stall avoidance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# These machines stall reverse-DNS look-ups of 127.0.0.1 for 5 s now and then;
# one attempt with a 1 s timeout bounds the stall for every process we start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

_TIERS = {"unit", "multiproc", "slurm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier of the folder it lives in (tests/<tier>/...)."""
    root = Path(__file__).parent
    for item in items:
        try:
            tier = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in _TIERS and not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
