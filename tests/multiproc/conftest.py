"""Markers of the multiproc folder beyond its tier: ``browser`` (headless Chromium); and the
end of every rank a test launched through ``helpers_inprocess``, however the test ended."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _end_launched_ranks() -> Iterator[None]:
    """Kill and reap the rank processes a test launched and left running (a failed assertion
    before its ``wait``): processes we start, we end."""
    yield
    helpers = sys.modules.get("helpers_inprocess") or sys.modules.get("tests.multiproc.helpers_inprocess")
    if helpers is None:
        return
    while helpers.LAUNCHED:
        helpers.LAUNCHED.pop().kill()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "browser: renders a page in headless Chromium (installed by scripts/install_chromium.sh "
        "when root with apt; skipped with the reason otherwise)",
    )
