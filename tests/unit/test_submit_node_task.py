"""The node task of ``nvrx.submit`` (``run_node``) under submitit's local executor, with the
supervisor replaced by a stand-in that records what it was started with and plays the ranks."""

from __future__ import annotations

import importlib
import os
import stat
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from nvrx import jobenv
from nvrx.checkpoint_flag import PREEMPT_FLAG_ENV
from nvrx.submission import node_task, run_callable
from nvrx.submission.call_spec import dump_spec
from nvrx.submission.job import JobFailed
from nvrx.submission.node_task import (
    NodeSpec,
    node_command,
    run_node,
    submitters_path,
    supervise_argv,
)
from nvrx.submission.private_files import write_private
from nvrx.submission.run_callable import read_outcome, result_path, write_outcome
from nvrx.submission.submit import Executor
from nvrx.supervisor.cli import build_parser
from nvrx.supervisor.exit_codes import CLEAN_STOP_EXIT, ExitCode
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
def local_task(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """This process is the task of a local job (no SLURM job of its own) whose submitit
    folder is ``tmp_path/<job id>``; its umask is restored afterwards (run_node sets it)."""
    for name, value in LOCAL_TASK_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path / "%j"))  # as submitit's job runner
    # from_env exports the flag: set first, so that monkeypatch takes it away (or puts back
    # the one there was) after the test; delenv of a missing variable restores nothing
    monkeypatch.setenv(PREEMPT_FLAG_ENV, "")
    monkeypatch.delenv(PREEMPT_FLAG_ENV)
    umask = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(umask)


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


def _rank_raised(result_dir: Path) -> None:
    write_outcome(result_dir, 0, ("error", "Traceback (most recent call last):\nValueError: bad batch 1234\n"))


def test_a_failed_job_says_what_its_ranks_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """The supervisor exits non-zero (restart budget used up): JobFailed carries the traceback
    each rank wrote. Before: only the exit code and the events folder, the exception nowhere."""
    supervisor = Supervisor(rc=int(ExitCode.BUDGET_EXHAUSTED), ranks=_rank_raised)
    with pytest.raises(JobFailed) as failed:
        _run(tmp_path, monkeypatch, supervisor, nproc_per_node=2)
    message = str(failed.value)
    assert f"on node 0 of job {JOB_ID} exited {int(ExitCode.BUDGET_EXHAUSTED)}" in message
    assert "rank 0 failed:\nTraceback (most recent call last):\nValueError: bad batch 1234" in message
    assert "rank 1" not in message  # it wrote no error


def test_a_failed_job_says_what_another_nodes_rank_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """Node 0 of a 2-node job fails because a rank of node 1 raised: its JobFailed, which
    submitit reports first, carries that rank's error from the shared results folder.
    Before: node 0 read only its own ranks' outcomes, and named no failing rank."""
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_NUM_NODES", "2")

    def node1_rank_raised(result_dir: Path) -> None:
        write_outcome(result_dir, 3, ("error", "Traceback (most recent call last):\nOSError: disk\n"))

    supervisor = Supervisor(rc=int(ExitCode.BUDGET_EXHAUSTED), ranks=node1_rank_raised)
    with pytest.raises(JobFailed) as failed:
        _run(tmp_path, monkeypatch, supervisor, nproc_per_node=2)
    assert "rank 3 failed:\nTraceback (most recent call last):\nOSError: disk" in str(failed.value)


def test_a_failed_job_quotes_a_few_ranks_errors_and_counts_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """Every rank of a large job may fail: the message quotes the first ones, not them all."""
    nproc = node_task.MAX_RANK_ERRORS + 3

    def every_rank_raised(result_dir: Path) -> None:
        for rank in range(nproc):
            write_outcome(result_dir, rank, ("error", f"Traceback (most recent call last):\nOSError: {rank}\n"))

    supervisor = Supervisor(rc=int(ExitCode.BUDGET_EXHAUSTED), ranks=every_rank_raised)
    with pytest.raises(JobFailed) as failed:
        _run(tmp_path, monkeypatch, supervisor, nproc_per_node=nproc)
    message = str(failed.value)
    assert message.count(" failed:\nTraceback") == node_task.MAX_RANK_ERRORS, message
    assert "... and 3 more rank(s): their outcomes are in " in message


def returns_a_lock(runs: str) -> dict:
    with open(runs, "a") as fh:
        fh.write("ran\n")
    return {"model": "ok", "lock": threading.Lock()}


def test_an_unpicklable_return_value_stops_the_job_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank writes why as its error and exits 130: the supervisor stops the job instead
    of restarting the finished training (before: exit 1, restarts until the loop breaker)."""
    spec = dump_spec(tmp_path / "specs" / "a.pkl", returns_a_lock, (str(tmp_path / "runs"),), {})
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("NVRX_RESULT_DIR", str(tmp_path / "results"))
    assert run_callable.main([str(spec)]) == CLEAN_STOP_EXIT
    status, error = read_outcome(tmp_path / "results", 3)
    assert status == "error" and "cannot pickle the return value of rank 3 (dict)" in error
    assert "lock" in error


def test_the_nodes_pythonpath_follows_the_submitters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """The children import from the submitter's sys.path first, then from the node's own
    PYTHONPATH (a module system's, a setup line's). Before: the submitter's replaced it."""
    monkeypatch.setenv("PYTHONPATH", f"/opt/node-only-libs{os.pathsep}/opt/more")
    spec = Executor(tmp_path, cluster="local")._node_spec(["python", "train.py"], "USR2")
    monkeypatch.setattr(sys, "path", list(sys.path))  # run_node extends it
    supervisor = Supervisor()
    monkeypatch.setattr(node_task, "_supervise", supervisor)
    run_node(spec)
    paths = supervisor.env["PYTHONPATH"].split(os.pathsep)
    submitters = [p for p in sys.path if p and os.path.isdir(p)]
    assert paths[-2:] == ["/opt/node-only-libs", "/opt/more"]
    assert paths[:-2] == list(dict.fromkeys(submitters_path(submitters)))
    assert str(Path(__file__).parents[2]) in paths[:-2]  # the submitter's own code


def test_the_interpreters_own_paths_do_not_shadow_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """The submitter's standard library and site-packages are the node's too (the same
    interpreter), after the node's PYTHONPATH: they are not put before it. Before: they were,
    and a package of the node's PYTHONPATH was shadowed by the submitter's site-packages."""
    import site
    import sysconfig

    monkeypatch.setenv("PYTHONPATH", "/opt/node-only-libs")
    spec = Executor(tmp_path, cluster="local")._node_spec(["python", "train.py"], "USR2")
    own = [sysconfig.get_paths()["stdlib"], *site.getsitepackages()]
    assert not set(own) & set(spec.python_path)
    supervisor = Supervisor()
    monkeypatch.setattr(sys, "path", list(sys.path))  # run_node extends it
    monkeypatch.setattr(node_task, "_supervise", supervisor)
    run_node(spec)
    paths = supervisor.env["PYTHONPATH"].split(os.pathsep)
    assert not set(own) & set(paths) and paths[-1] == "/opt/node-only-libs"
    # a spec that names them anyway (pickled by an older nvrx): the node leaves them out too
    direct = _spec(tmp_path, python_path=[*own, str(tmp_path)])
    _, env = node_command(direct, JOB_ID, "local", {"PYTHONPATH": "/opt/node-only-libs"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/opt/node-only-libs"]


def test_results_of_classes_only_the_submitter_can_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """A rank returns an object of a module found through the submitter's sys.path (a
    notebook's sys.path.append, a script's own folder), which the node task does not have.
    Before: unpickling the rank's result in the node task raised ModuleNotFoundError."""
    source = tmp_path / "src_only"
    source.mkdir()
    module = f"nvrx_test_metrics_{os.getpid()}"
    (source / f"{module}.py").write_text(
        "class Metrics:\n    def __init__(self, loss):\n        self.loss = loss\n"
    )
    monkeypatch.setattr(sys, "path", [str(source), *sys.path])
    metrics = importlib.import_module(module)
    outcome = cloudpickle.dumps(("success", metrics.Metrics(0.5)))  # by reference: importable
    spec = Executor(tmp_path, cluster="local")._node_spec(["python", "train.py"], "USR2")
    sys.path.remove(str(source))  # the node task's own sys.path does not have it
    del sys.modules[module]

    def rank_returned(result_dir: Path) -> None:
        write_private(result_path(result_dir, 0), outcome)

    monkeypatch.setattr(node_task, "_supervise", Supervisor(ranks=rank_returned))
    value = run_node(spec)["results"][0]
    assert (type(value).__module__, type(value).__name__, value.loss) == (module, "Metrics", 0.5)
    monkeypatch.delitem(sys.modules, module)


def test_submitits_files_of_the_job_are_the_users_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_task: None
) -> None:
    """submitit's folder of the job becomes 0700 and what the task writes after the
    supervisor, submitit's pickle of the return values, is written under umask 0o077; the
    supervisor and its ranks keep the user's umask. Before: the folder stayed 0755 and the
    result pickle was written 0644, readable by everyone."""
    job_folder = tmp_path / JOB_ID
    job_folder.mkdir(mode=0o755)
    job_folder.chmod(0o755)
    umasks: list[int] = []

    def ranks(result_dir: Path) -> None:
        umasks.append(os.umask(0o022))

    _run(tmp_path, monkeypatch, Supervisor(ranks=ranks))
    assert stat.S_IMODE(job_folder.stat().st_mode) == 0o700
    assert umasks == [0o022]  # the supervisor's
    (job_folder / "written_after").write_bytes(b"x")  # as submitit writes its result pickle
    assert stat.S_IMODE((job_folder / "written_after").stat().st_mode) == 0o600


def test_a_debug_job_leaves_the_submitters_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """submitit's debug executor runs the node task in the submitter's own process: the task
    leaves its umask as it was. Before: the submitter went on with umask 0o077."""
    for name in [*LOCAL_TASK_ENV, "SUBMITIT_FOLDER", PREEMPT_FLAG_ENV]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SUBMITIT_DEBUG_JOB_ID", JOB_ID)  # as submitit's debug job sets it
    umask = os.umask(0o022)
    try:
        result = _run(tmp_path, monkeypatch, Supervisor())
        after = os.umask(0o022)
    finally:
        os.umask(umask)
    assert result["job_id"] == JOB_ID
    assert after == 0o022


@pytest.mark.parametrize(
    "given",
    [["--master_port", "5000", "--store_port", "5003"], ["--master_port=5000", "--store_port=5003"]],
)
def test_ports_in_supervise_args_win_in_either_spelling(tmp_path: Path, given: list[str]) -> None:
    """nvrx-supervise takes torchrun's underscore spellings too. Before: only the dashed ones
    were seen, and the ports of the job id, appended after, overrode the caller's."""
    argv, _ = node_command(_spec(tmp_path, supervise_args=given), JOB_ID, "local", {})
    options = build_parser().parse_args(argv[len(supervise_argv()) :])
    assert (options.master_port, options.store_port) == (5000, 5003)
    assert "--master-port" not in argv and "--store-port" not in argv


def test_a_project_folder_under_the_interpreters_prefix_is_passed_on() -> None:
    """A system Python's prefix is ``/usr``, and projects live under it (``/usr/src/app`` in
    many images): only the interpreter's standard library and site-packages are left out."""
    project = Path(tempfile.mkdtemp(prefix="nvrx-test-project-", dir=sys.prefix))
    try:
        assert submitters_path([str(project), sysconfig.get_paths()["purelib"]]) == [str(project)]
    finally:
        project.rmdir()
