"""Shared test setup: tier markers and worker groups by folder, ``--repeat-each N`` for flake hunting, loopback DNS stall avoidance."""

from __future__ import annotations

import os
from typing import Any

import pytest

# These machines stall reverse-DNS look-ups of 127.0.0.1 for 5 s now and then;
# one attempt with a 1 s timeout bounds the stall for every process we start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

_TIERS = {"unit", "multiproc", "slurm"}


#: Folders whose tests share one costly session fixture (the local SLURM cluster, the
#: differential tier's scenario runs): under pytest-xdist (``-n N``) each runs whole on
#: one worker, which sets that fixture up once (``pytest_xdist_make_scheduler``). That
#: fixture lasts until its worker's session ends (the cluster's daemons idle meanwhile).
_ONE_WORKER = ("slurm", "differential")
#: The order in which xdist hands out units of work: the longest first, so that the
#: unit tests' many short ones fill the end.
_UNIT_ORDER = (*_ONE_WORKER, "multiproc", "unit")


def _folder(nodeid: str) -> str:
    """The folder under tests/ of a test's node id (rootdir-relative: ``tests/<folder>/...``)."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier of the folder it lives in (tests/<tier>/...); in an
    xdist worker, order them as ``_UNIT_ORDER`` says (every worker the same way)."""
    for item in items:
        tier = _folder(item.nodeid)
        if tier in _TIERS and not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
    if hasattr(config, "workerinput"):
        rank = {folder: i for i, folder in enumerate(_UNIT_ORDER)}
        items.sort(key=lambda item: rank.get(_folder(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Units of work for the xdist workers under ``-n N`` (xdist's default ``--dist load``;
    another ``--dist`` given keeps its own): each folder of ``_ONE_WORKER`` is one, every
    other test file one (its module fixtures, a demo run for instance, are set up once),
    handed out in the workers' collection order."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            folder = _folder(nodeid)
            return folder if folder in _ONE_WORKER else nodeid.split("::")[0]

    config.option.loadscopereorder = False  # keep the order above, not the biggest unit first
    return FolderUnits(config, log)


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
