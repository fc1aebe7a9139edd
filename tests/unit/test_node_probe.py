"""Probes of lost nodes (``nvrx.supervisor.node_probe``): a real child process per probe,
polled, never waited for beyond its timeout, and ended with the supervisor. ``srun`` is a
small script on PATH that answers for node ``up`` and never for node ``down``; the real
``srun`` runs it in the slurm tier."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psutil
import pytest

from nvrx.supervisor.node_probe import NodeProbes
from tests.support.waiting import wait_until

SRUN = """#!/bin/sh
for arg in "$@"; do
  case "$arg" in --nodelist=up) exit 0 ;; esac
done
exec sleep 300
"""


@pytest.fixture
def srun_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return srun


def _sleepers() -> list[int]:
    """Our ``srun`` stand-ins still alive (the sleep they became)."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "sleep" and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_each_probe_is_recorded_once_with_its_answer(srun_on_path: Path) -> None:
    events: list[tuple[str, dict]] = []
    probes = NodeProbes(lambda kind, **f: events.append((kind, f)), job_id="42", timeout=1.0)
    assert probes.start(1, "up") and probes.start(2, "down")
    assert probes.deadline() is not None
    wait_until("both probes recorded", lambda: probes.poll() or len(events) == 2, 30)
    by_host = {f["lost_host"]: f for _, f in events}
    assert {kind for kind, _ in events} == {"node_probe"}
    assert (by_host["up"]["responding"], by_host["up"]["lost_slot"]) == (True, 1)
    assert by_host["down"]["responding"] is False
    assert by_host["down"]["note"] == "no answer within the probe's timeout"
    assert by_host["down"]["probe_s"] >= 1.0
    assert probes.deadline() is None and not _sleepers()


def test_a_probe_the_supervisor_outlives_is_ended_and_its_answer_unknown(srun_on_path: Path) -> None:
    events: list[dict] = []
    probes = NodeProbes(lambda kind, **f: events.append(f), job_id="42", timeout=300.0)
    assert probes.start(3, "down")
    wait_until("the probe's srun to run", lambda: bool(_sleepers()), 30)
    probes.close()
    assert [(e["lost_slot"], e["responding"], e["note"]) for e in events] == [
        (3, None, "the supervisor ended first")
    ]
    assert not _sleepers()


def test_nothing_is_asked_outside_slurm_or_of_an_unknown_host() -> None:
    events: list[dict] = []
    assert not NodeProbes(lambda kind, **f: events.append(f), job_id="").start(1, "up")
    assert not NodeProbes(lambda kind, **f: events.append(f), job_id="42").start(1, None)
    assert events == []
