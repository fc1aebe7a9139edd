"""Markers of the multiproc folder beyond its tier: ``browser`` (headless Chromium)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "browser: renders a page in headless Chromium (installed by scripts/install_chromium.sh "
        "when root with apt; skipped with the reason otherwise)",
    )
