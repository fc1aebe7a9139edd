"""``fork_and_monitor`` in the batch script of a job of several tasks (SLURM's variables, but no
``SLURM_STEP_ID``: no srun started it) refuses at once and names srun, instead of taking itself
for task 0 of them and waiting for tasks that never start; the batch script of a one-task job,
and the tasks srun starts, go on as before. A malformed SLURM variable is refused too, in one line
that names it and its value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx.supervisor.config import ConfigError
from nvrx.supervisor.fork_and_monitor import _job

CHECKOUT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("SLURM_", "PET_", "NVRX_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_")


def _batch_shell(nodes: int, tasks: int | None) -> dict[str, str]:
    """The environment of a batch script, as sbatch gives it: SLURM's variables of task 0
    (``SLURM_NTASKS`` only when the job asked for a task count), but no step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHERS)}
    env.update(
        SLURM_JOB_ID="77", SLURM_JOB_NODELIST=f"node[1-{nodes}]" if nodes > 1 else "node1",
        SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_NODEID="0", SLURM_PROCID="0",
    )  # fmt: skip
    if tasks is not None:
        env["SLURM_NTASKS"] = str(tasks)
    return env


@pytest.mark.parametrize(("nodes", "tasks", "said"), [(2, None, "2 tasks"), (1, 4, "4 tasks, not by srun")])
def test_the_batch_script_of_several_tasks_is_refused_naming_srun(
    nodes: int, tasks: int | None, said: str
) -> None:
    """Before: it took itself for task 0 of them, ran the script, and waited as the store's host
    for tasks that never start."""
    with pytest.raises(ConfigError) as refused:
        _job(_batch_shell(nodes, tasks), None)
    for part in (f"started in the batch script of a job of {said}", "SLURM_PROCID=0",
                 "no SLURM_STEP_ID", "`srun python SCRIPT ...`"):  # fmt: skip
        assert part in str(refused.value)


def test_one_task_in_the_batch_script_and_the_tasks_of_srun_still_start() -> None:
    alone = _job(_batch_shell(1, None), None)
    assert (alone.nnodes, alone.node_rank, alone.job_id) == (1, 0, "77")
    task = _batch_shell(2, 4) | {
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_NODEID": "1",
    }  # fmt: skip
    under_srun = _job(task, None)
    assert (under_srun.nnodes, under_srun.node_rank) == (4, 3)


def _run_script(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A script that calls ``fork_and_monitor`` first, then says that its body ran."""
    script = tmp_path / "train.py"
    script.write_text(
        "import nvrx\n"
        "nvrx.fork_and_monitor(store_timeout=5, finish_timeout=5)\n"
        "print('the body ran', flush=True)\n"
    )
    env = env | {"PYTHONPATH": str(CHECKOUT), "NVRX_LOG_DIR": str(tmp_path / "logs")}
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_a_script_in_the_batch_script_of_several_tasks_exits_2_before_it_forks(tmp_path: Path) -> None:
    """One line on stderr, exit 2 (a configuration to fix), and the script's body never runs."""
    done = _run_script(tmp_path, _batch_shell(2, 2))
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("nvrx fork_and_monitor: error: started in the batch script of a job of 2 tasks")


def test_a_bad_slurm_variable_is_one_line_and_exit_2_before_it_forks(tmp_path: Path) -> None:
    """Before: the ConfigError left the call as a traceback, and the script exited 1."""
    task = _batch_shell(2, 2) | {
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[2-1]", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
    }  # fmt: skip
    done = _run_script(tmp_path, task)
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "nvrx fork_and_monitor: error: cannot read the SLURM topology: "
        "SLURM_STEP_NODELIST='node[2-1]': range '2-1' goes down, in node list 'node[2-1]'"
    ]


def _task(**changed: str) -> dict[str, str]:
    """Task 3 of a step of 4 tasks on 2 nodes, with ``changed`` variables."""
    return _batch_shell(2, 4) | {
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_NODEID": "1", **changed,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"SLURM_NTASKS": "2(x2)"}, "SLURM_NTASKS='2(x2)' is not an integer"),
        ({"SLURM_NTASKS": "", "SLURM_NPROCS": "four"}, "SLURM_NPROCS='four' is not an integer"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS=0 is not at least 1"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside 0..3"),
    ],
)
def test_a_malformed_task_count_or_task_rank_names_the_variable_and_its_value(
    changed: dict[str, str], said: str
) -> None:
    """Before: a bare ValueError of ``int()`` that named neither."""
    with pytest.raises(ConfigError) as refused:
        _job(_task(**changed), None)
    assert str(refused.value) == f"cannot read the SLURM topology: {said}"


def test_a_malformed_task_rank_is_one_line_and_exit_2_before_it_forks(tmp_path: Path) -> None:
    """Before: a traceback, and the script exited 1."""
    done = _run_script(tmp_path, _task(SLURM_PROCID="x"))
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "nvrx fork_and_monitor: error: cannot read the SLURM topology: SLURM_PROCID='x' is not an integer"
    ]
