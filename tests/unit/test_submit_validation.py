"""``nvrx.submit`` refuses bad parameters before anything is submitted, naming the parameter."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import nvrx
from nvrx.submission.submit import Executor, SubmitError, submit


def _noop() -> int:
    return 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"nodes": 0}, "nodes must be at least 1, got 0"),
        ({"nodes": "2"}, "nodes must be an integer, got '2'"),
        ({"nproc_per_node": 0}, "nproc_per_node must be at least 1, got 0"),
        ({"nproc_per_node": 1.5}, "nproc_per_node must be an integer, got 1.5"),
        ({"tasks_per_node": 4}, "tasks_per_node must be 1 .* got 4"),
        ({"timeout_min": 0}, "timeout_min must be at least 1, got 0"),
        (
            {"timeout_min": 1, "signal_delay_s": 60},
            "signal_delay_s=60 must be below the time limit timeout_min=1",
        ),
        ({"signal_delay_s": -1}, "signal_delay_s must be an integer >= 0, got -1"),
        (
            {"max_time_limit_requeues": -2},
            "max_time_limit_requeues must be an integer >= 0, got -2",
        ),
        ({"supervise_args": "--max-restarts 3"}, "supervise_args must be a list of strings"),
        ({"nodes": 2}, "nodes=2 needs SLURM"),
    ],
)
def test_bad_parameters_fail_before_submission(tmp_path: Path, params: dict, message: str) -> None:
    with pytest.raises(SubmitError, match=message):
        submit(_noop, folder=tmp_path, cluster="local", **params)
    assert not (tmp_path / "specs").exists()  # nothing was written for a job


def test_update_parameters_checks_too(tmp_path: Path) -> None:
    executor = Executor(tmp_path, cluster="local")
    with pytest.raises(SubmitError, match="nproc_per_node must be at least 1, got -1"):
        executor.update_parameters(nproc_per_node=-1)


def test_unknown_submitit_parameter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SubmitError, match="submitit refused the parameters: .*bogus"):
        submit(_noop, folder=tmp_path, cluster="local", bogus_param=1)


def test_unknown_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SubmitError, match="cluster='nowhere'"):
        Executor(tmp_path, cluster="nowhere")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (42, "target must be a callable, a command string or a list of strings, got 42"),
        ([], "target must be a callable"),
        ("", "target is an empty command"),
    ],
)
def test_bad_targets(tmp_path: Path, target: object, message: str) -> None:
    with pytest.raises(SubmitError, match=message):
        submit(target, folder=tmp_path, cluster="local")  # type: ignore[arg-type]


def test_command_takes_no_arguments(tmp_path: Path) -> None:
    with pytest.raises(SubmitError, match="arguments are for a callable target"):
        submit(["python", "-c", "pass"], args=(1,), folder=tmp_path, cluster="local")


def test_unpicklable_callable_names_itself(tmp_path: Path) -> None:
    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(SubmitError, match="cannot pickle .*uses_lock"):
        submit(uses_lock, folder=tmp_path, cluster="local")


def test_lazy_exports() -> None:
    assert nvrx.submit is submit
    assert nvrx.Executor is Executor
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        nvrx.nope  # noqa: B018


def test_submitits_signal_delay_is_nvrxs(tmp_path: Path) -> None:
    """submitit's slurm_signal_delay_s sets the delay the supervisors use to tell a time limit
    from a preemption, and what SLURM is asked for: one setting under two names."""
    executor = Executor(tmp_path, cluster="local", timeout_min=10, slurm_signal_delay_s=120)
    assert executor._nvrx["signal_delay_s"] == 120
    executor.update_parameters(signal_delay_s=120, slurm_signal_delay_s=120)  # the same: fine
    with pytest.raises(SubmitError, match=r"signal_delay_s=90 and slurm_signal_delay_s=120 are one setting"):
        executor.update_parameters(signal_delay_s=90, slurm_signal_delay_s=120)
    with pytest.raises(SubmitError, match="signal_delay_s=600 must be below the time limit"):
        executor.update_parameters(slurm_signal_delay_s=600)  # checked like nvrx's own name
    executor.cluster = "slurm"  # what sbatch would be asked for
    assert executor._submitit_parameters()["slurm_signal_delay_s"] == 120


def test_without_timeout_min_the_delay_is_checked_against_the_default_limit(
    tmp_path: Path,
) -> None:
    """No timeout_min: nvrx gives submitit its default of 5 minutes on every cluster, and
    checks signal_delay_s against it. Before: nothing was checked, and submitit's local
    executor took its own 2 minutes, so the default 90 s warning came 30 s after the start
    of every local job (a 45 s function was requeued until the cap, never finished)."""
    with pytest.raises(
        SubmitError,
        match=r"signal_delay_s=300 must be below the time limit of nvrx's default "
        r"timeout_min=5 \(300 s\)",
    ):
        submit(_noop, folder=tmp_path, cluster="local", signal_delay_s=300)
    executor = Executor(tmp_path, cluster="local")
    executor._prepare()
    local = executor._executor._executor.parameters  # what submitit's local controller gets
    assert (local["timeout_min"], local["signal_delay_s"]) == (5, 90)
    executor.update_parameters(timeout_min=30)
    executor._prepare()
    assert executor._executor._executor.parameters["timeout_min"] == 30


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--nproc-per-node", "2"], "--nproc-per-node"),
        (["--nproc_per_node=2"], "--nproc_per_node"),
        (["--max-restarts", "3", "--nnodes", "2"], "--nnodes"),
        (["--node_rank", "1"], "--node_rank"),
        (["--master-addr", "elsewhere"], "--master-addr"),
        (["--job-id", "mine"], "--job-id"),
        (["--log_dir", "/elsewhere"], "--log_dir"),
    ],
)
def test_supervise_args_may_not_reset_what_every_node_is_given(
    tmp_path: Path, args: list[str], option: str
) -> None:
    """Before: accepted; the supervisors obeyed them and the job handle did not (ranks it
    did not count, events where its report does not look)."""
    with pytest.raises(SubmitError, match=f"supervise_args: {option} is set for every node"):
        submit(_noop, folder=tmp_path, cluster="local", supervise_args=args)
    executor = Executor(tmp_path, cluster="local")
    executor.update_parameters(supervise_args=["--max_restarts", "3", "--master_port", "5000"])
    assert executor._nvrx["supervise_args"][0] == "--max_restarts"  # others are the caller's


def test_update_parameters_refuses_unknown_names_at_once(tmp_path: Path) -> None:
    """Before: accepted, then refused by every submission after it."""
    executor = Executor(tmp_path, cluster="local", timeout_min=10)
    with pytest.raises(SubmitError, match="submitit refused the parameters: .*bogus_param"):
        executor.update_parameters(bogus_param=1, nproc_per_node=2)
    assert "bogus_param" not in executor._submitit and executor._nvrx["nproc_per_node"] == 1
    executor._prepare()  # what submit does before submitting: the executor still works


def test_errors_name_the_parameter_as_last_given(tmp_path: Path, monkeypatch) -> None:
    """A later update under another name of the time limit is the name errors use."""
    from submitit.slurm.slurm import SlurmExecutor

    # submitit's SLURM executor refuses to be made where srun is missing (a machine
    # without SLURM): its CPUs per task are what srun would say
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    executor = Executor(tmp_path, cluster="slurm", slurm_time=60)
    with pytest.raises(SubmitError, match=r"time limit timeout_min=1 \(60 s\)"):
        executor.update_parameters(timeout_min=1)
    executor.update_parameters(timeout_min=2)
    with pytest.raises(SubmitError, match=r"time limit timeout_min=2 \(120 s\)"):
        executor.update_parameters(signal_delay_s=120)
