"""A node without SLURM's client commands (common inside containers): one clear message
naming the command, and the caller's fallback, never an uncaught error."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nvrx.slurm import commands
from nvrx.supervisor.warning_cause import partition_grace_time


def test_a_missing_command_is_a_slurm_command_error_that_names_it(tmp_path: Path) -> None:
    with pytest.raises(commands.SlurmCommandMissing) as caught:
        commands.run_command(["scontrol", "show", "job", "1"], env={"PATH": str(tmp_path)})
    assert isinstance(caught.value, commands.SlurmCommandError)  # every caller's fallback applies
    assert str(caught.value).startswith("scontrol cannot run here")
    assert "SLURM's client commands" in str(caught.value)
    assert caught.value.returncode == 127  # None would read as a timeout


def test_a_caller_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert partition_grace_time({"Partition": "debug"}) is None  # the default window instead
    (record,) = caplog.records
    assert "GraceTime of partition debug" in record.getMessage()
    assert "scontrol cannot run here" in record.getMessage()
