"""The benches' figures count what they say they count (``bench/``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [2, 4])
def test_straggler_store_traffic_counts_every_store_request_of_the_sealed_path(hosts: int) -> None:
    """Each node sets its step times and checks the exclusion list (absent here); the store's
    host checks and gets every node's step times: four store requests per node per interval,
    but three in the first, where the store's host reads the others before they published."""
    requests, size, _ = _bench("straggler_cost").store_traffic(8, hosts, intervals=10)
    assert requests * 10 == pytest.approx(9 * 4 * hosts + (4 * hosts - (hosts - 1)))
    assert size > 0
