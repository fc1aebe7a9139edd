"""The node task of ``nvrx.submit`` (``run_node``) under submitit's local executor, with the
supervisor replaced by a stand-in that records what it was started with and plays the ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvrx import jobenv
from nvrx.checkpoint_flag import PREEMPT_FLAG_ENV
from nvrx.submission import node_task
from nvrx.submission.node_task import NodeSpec, run_node, supervise_argv
from nvrx.supervisor.cli import build_parser
from nvrx.supervisor.preemption import PreemptionHandler

JOB_ID = "4321"
#: What submitit's local controller sets for the task (``submitit.local.local``).
LOCAL_TASK_ENV = {
    "SUBMITIT_EXECUTOR": "local",
    "SUBMITIT_LOCAL_JOB_ID": JOB_ID,
    "SUBMITIT_LOCAL_NTASKS": "1",
    "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
    "SUBMITIT_LOCAL_NODEID": "0",
    "SUBMITIT_LOCAL_GLOBALID": "0",
    "SUBMITIT_LOCAL_LOCALID": "0",
}


class Supervisor:
    """Stands in for ``_supervise``: records the command line and environment, then runs
    ``ranks(result_dir)`` (what the children would write) and returns ``rc``."""

    def __init__(self, rc: int = 0, ranks: Callable[[Path], None] | None = None) -> None:
        self.rc = rc
        self.ranks = ranks
        self.argv: list[str] = []
        self.env: dict[str, str] = {}

    def __call__(self, argv: list[str], env: dict[str, str], *signals: Any) -> int:
        self.argv, self.env = argv, env
        if self.ranks is not None:
            self.ranks(Path(env["NVRX_RESULT_DIR"]))
        return self.rc

    def options(self) -> Any:
        """The supervisor's options, as ``nvrx-supervise`` parses them."""
        return build_parser().parse_args(self.argv[len(supervise_argv()) :])


@pytest.fixture
def local_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is the task of a local job (no SLURM job of its own)."""
    for name, value in LOCAL_TASK_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(PREEMPT_FLAG_ENV, raising=False)  # restored after from_env sets it


def _spec(tmp_path: Path, **fields: Any) -> NodeSpec:
    return NodeSpec(
        **{
            "command": ["python", "train.py"],
            "nproc_per_node": 1,
            "supervise_args": [],
            "log_dir": str(tmp_path / "nvrx_logs"),
            "result_root": str(tmp_path / "results"),
            **fields,
        }
    )


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, supervisor: Supervisor, **spec: Any) -> Any:
    monkeypatch.setattr(node_task, "_supervise", supervisor)
    return run_node(_spec(tmp_path, **spec))


def test_a_local_job_inside_an_allocation_is_not_the_allocations_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """Run from a shell inside a SLURM allocation, a local job's supervisor gets none of the
    allocation's SLURM_* variables, and the ports of its own job id. Before: it took the
    allocation's job for its own, and a warning requeued the allocation (scontrol requeue)."""
    for name, value in {
        "SLURM_JOB_ID": "777", "SLURM_NODELIST": "n1", "SLURM_RESTART_COUNT": "2",
        "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1", "SLURM_STEP_ID": "0",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    supervisor = Supervisor()
    assert _run(tmp_path, monkeypatch, supervisor) == {"node": 0, "job_id": JOB_ID, "results": {}}
    assert not [name for name in supervisor.env if name.startswith("SLURM")]
    assert supervisor.env["NVRX_JOB_ID"] == JOB_ID
    options = supervisor.options()
    master, store = jobenv.ports_for_job(f"local-{JOB_ID}")
    assert (options.master_port, options.store_port) == (master, store)
    handler = PreemptionHandler.from_env(0, 1, job_dir=tmp_path, env=supervisor.env)
    assert (handler.slurm, handler.job_id, handler.local_requeue) == (False, None, True)
