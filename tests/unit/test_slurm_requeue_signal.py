"""``scontrol requeue`` of the job it runs in: SLURM ends that job at once, sending SIGTERM
to every process of it, the command included (CI run 29: "scontrol requeue 19 exited
-15", and the job was not counted as requeued). The command must outlive that signal.

The ``scontrol`` here does what SLURM does to it: it sends SIGTERM to its own process
group (``run_command`` starts each command leading one), then answers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nvrx.slurm import commands

SCONTROL = f"""#!{sys.executable}
import os, signal, sys, time
os.killpg(0, signal.SIGTERM)  # the job ends: every process of it gets SIGTERM
time.sleep(0.2)
print("requeued", *sys.argv[1:])
"""


@pytest.fixture
def path(tmp_path: Path) -> str:
    program = tmp_path / "scontrol"
    program.write_text(SCONTROL)
    program.chmod(0o755)
    return str(tmp_path)


def test_requeue_outlives_the_sigterm_of_the_job_it_ends(path: str) -> None:
    commands.requeue(4242, env={"PATH": path})


def test_without_that_the_command_would_die_of_it(path: str) -> None:
    with pytest.raises(commands.SlurmCommandError) as caught:
        commands.run_command(["scontrol", "requeue", "4242"], env={"PATH": path})
    assert caught.value.returncode == -15
