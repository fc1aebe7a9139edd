"""Fixtures shared by unit tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvrx.store import client


@pytest.fixture()
def base() -> Iterator[Any]:
    """A client of a real TCPStore server on loopback, served for this test only."""
    server = client.serve("127.0.0.1", 0, timeout=10)
    yield client.connect("127.0.0.1", server.port, timeout=10)
    del server


@pytest.fixture
def sockets_dir() -> Iterator[Path]:
    """A private directory with a short path, for tests that bind Unix sockets below it: a
    socket path has at most 107 bytes, and pytest's own temporary paths can be longer
    (under pytest-xdist, for instance)."""
    path = Path(tempfile.mkdtemp(prefix="nvrx-sock-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
