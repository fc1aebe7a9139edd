"""Fixtures shared by unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from nvrx.store import client


@pytest.fixture()
def base() -> Iterator[Any]:
    """A client of a real TCPStore server on loopback, served for this test only."""
    server = client.serve("127.0.0.1", 0, timeout=10)
    yield client.connect("127.0.0.1", server.port, timeout=10)
    del server
