"""The differential tier's own rule for a reference that hangs: it runs once more, nvrx never.

These run without the reference installed: the runs are functions in a thread pool, as
the tier's fixture submits ``run`` for each implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from differential_harness import ScenarioTimedOut, both_records

pytestmark = pytest.mark.differential

RECORD = [{"rank": 0, "returned": 1}]


def _both(
    reference: Callable[[], Any], nvrx: Callable[[], Any], started: list[str]
) -> dict[str, Any]:
    """``both_records`` of the two runs; each run it starts again is added to ``started``."""

    def again() -> list[dict[str, Any]]:
        started.append("reference")
        return RECORD

    with ThreadPoolExecutor(2) as pool:
        futures = {"reference": pool.submit(reference), "nvrx": pool.submit(nvrx)}
    return both_records(futures, again)


def _timed_out() -> Any:
    raise ScenarioTimedOut("reference wrapper_rounds.py rank 1: exit None")


def _failed() -> Any:
    raise AssertionError("nvrx wrapper_rounds.py rank 0: exit 1")


def _reference_failed() -> Any:
    raise AssertionError("reference wrapper_rounds.py rank 0: exit 1")


def test_a_reference_that_ran_past_its_timeout_runs_once_more_and_nvrx_once() -> None:
    started: list[str] = []

    def nvrx() -> list[dict[str, Any]]:
        started.append("nvrx")
        return RECORD

    with pytest.warns(UserWarning, match="runs once more: reference wrapper_rounds.py rank 1"):
        records = _both(_timed_out, nvrx, started)
    assert sorted(started) == ["nvrx", "reference"]  # nvrx's one run, the reference's second
    assert records == {"reference": RECORD, "nvrx": RECORD}


def test_a_failed_nvrx_run_is_told_first_and_nothing_runs_again() -> None:
    started: list[str] = []
    with pytest.raises(AssertionError, match="nvrx wrapper_rounds.py rank 0"):
        _both(_timed_out, _failed, started)
    assert started == []


def test_a_reference_that_failed_in_time_is_told_and_never_runs_again() -> None:
    """A reference that failed in time is a difference to report, not a hang to retry."""
    started: list[str] = []
    with pytest.raises(AssertionError, match="reference wrapper_rounds.py rank 0"):
        _both(_reference_failed, lambda: RECORD, started)
    assert started == []
