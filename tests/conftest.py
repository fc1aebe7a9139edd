"""Shared test setup: tier markers and worker groups by folder, ``--repeat-each N`` for flake hunting, loopback DNS stall avoidance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# These machines stall reverse-DNS look-ups of 127.0.0.1 for 5 s now and then;
# one attempt with a 1 s timeout bounds the stall for every process we start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

_TIERS = {"unit", "multiproc", "slurm"}


#: Folders whose tests share one costly session fixture (the local SLURM cluster, the
#: differential tier's scenario runs): with ``-n N --dist loadgroup`` (pytest-xdist) each
#: runs whole on one worker, which sets that fixture up once.
_ONE_WORKER = {"slurm", "differential"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier of the folder it lives in (tests/<tier>/...), and put the
    tests of each folder of ``_ONE_WORKER`` in one xdist group."""
    root = Path(__file__).parent
    for item in items:
        try:
            folder = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue
        if folder in _TIERS and not item.get_closest_marker(folder):
            item.add_marker(getattr(pytest.mark, folder))
        if folder in _ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(folder))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--repeat-each",
        type=int,
        default=1,
        metavar="N",
        help="run every selected test N times in a row, to hunt flaky tests (default 1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    repeat = config.getoption("repeat_each")
    if repeat < 1:
        raise pytest.UsageError(f"--repeat-each must be at least 1, got {repeat}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With ``--repeat-each N``, each test runs N times (fixtures of module or session scope are shared): ``test_x[repeat1of5]`` ... ``[repeat5of5]``."""
    repeat = metafunc.config.getoption("repeat_each")
    if repeat > 1:
        metafunc.fixturenames.append("_repeat_index")
        metafunc.parametrize(
            "_repeat_index", range(1, repeat + 1), ids=lambda i: f"repeat{i}of{repeat}"
        )
